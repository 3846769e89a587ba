"""Calibrating the drafter on the text it serves: a temperature per tree shape and each lookup's acceptance by depth.

    online = OnlineCalibration()                        # learns from every verified round (--online-calibration)
    generate(..., online=online)
    save_calibration(folder / CALIBRATION_FILE, online, facts)   # `ddtree calibrate`: ships beside the weights
    note_in_card(folder, created)                                # and an export's card says its figures are without it
    load_calibration(folder / CALIBRATION_FILE)                  # frozen: decoding uses it, learns nothing more

A drafter is over-confident on prompts unlike its training data (docs/objectives.md, Calibration), and the nodes a lookup
grafts are accepted far more often than the drafter's probabilities say. Both are measured only by decoding the
serving distribution: `--online-calibration` does it as it goes; `ddtree calibrate` does it once over a prompts
file and writes the result into the drafter folder, where `generate` and `bench` find it by default.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from .errors import DDTreeError
from .files import write_json_atomic, write_text_atomic
from .names import CALIBRATION_FILE, CORPUS_FILE, REPO_MARK  # noqa: F401 (CALIBRATION_FILE: importers read it from here too)

FORMAT_VERSION = 1
CHAIN = "chain"  # the chain's temperature in the file; a ddtree budget is written as its number
LOOKUPS = ("context", "corpus")  # the lookups whose grafted nodes it learns the acceptance of (graft_acceptance)
# How the paragraph `ddtree calibrate` adds to an export's card starts (note_in_card); --push-only looks for it
CARD_NOTE = "**Calibrated after these figures.**"
MEASURED_SECTION = "## Measured acceptance"  # the card's section of figures (training/model_card.py)


class OnlineCalibration:
    """A draft temperature per tree shape (a ddtree budget, or the chain), learned from verified rounds.

    Temperatures fitted on training data (`draft_temperatures`) cannot see how much less accurate the
    drafter is on the text it serves (docs/objectives.md, Calibration). Each verified round tells: after it, the log
    temperature moves by RATE x (expected - accepted length), a stochastic-approximation step, so an
    over-confident drafter is warmed and an under-confident one cooled until the expected acceptance
    tracks the measured one. It reorders the best-first tree, never what is committed (the target decides).

    With a context or corpus lookup, the nodes a graft adds are not the drafter's guesses, and their drafter
    probabilities say nothing of how often they are accepted. Instead each scores the learned chance
    that a node its lookup grafted at its depth is accepted (rounds with one, Laplace-smoothed; one table per
    lookup), so the expected acceptance counts the lookups too and the temperature is left to the drafter's
    own nodes.

    frozen: use what it holds and learn nothing more (a calibration file, as decoding uses it by default).
    record: keep every temperature it moves through, so that `settled` can average them (`ddtree calibrate`).
    A ddtree budget it has no temperature for takes the nearest budget's (a file calibrated at 32, decoded at 16).
    """

    RATE = 0.01
    LOG_LIMIT = 2.0  # temperatures stay within e^-2 .. e^2
    # the settings it was learned with, where it says (from_state): the lookup, redraft and corpus, and from `ddtree
    # calibrate` the sampling (temperature, top_p, top_k), target and dtype too
    decoded_with: dict | None = None
    weights: str | None = None  # the fingerprint of the weights a calibration file was learned on (load_calibration)

    def differences(self, now: dict) -> list[str]:
        """How decoding with the settings `now` (named as decoded_with names them) differs from those the file was
        learned with: its graft tables and temperatures price another tree or another acceptance, so the expected tau
        is off (in reviews: 3.34 expected, 1.90 measured for a file learned without lookups, decoded with them; 4.12
        expected, 7.23 measured for one learned sampling at temperature 1, decoded greedily). Only what both name is compared (a
        file written before it recorded a setting says nothing of it), and top_p and top_k not where both decode
        greedily, which ignores them."""
        learned = self.decoded_with or {}
        greedy = learned.get("temperature") == 0 and now.get("temperature") == 0
        return [f"{name} {learned[name]} here {value}" for name, value in now.items()
                if name in learned and learned[name] != value and not (greedy and name in ("top_p", "top_k"))]

    def __init__(self, frozen: bool = False, record: bool = False):
        self.frozen = frozen
        self.trajectory: dict[int | None, list[float]] | None = {} if record else None  # shape -> log T per round
        self.log_temperatures: dict[int | None, float] = {}  # ddtree budget (None = the chain) -> log T
        self.graft_rounds: dict[tuple[str, int], int] = {}  # (lookup, depth) -> rounds it grafted a node that deep
        self.graft_accepted: dict[tuple[str, int], int] = {}  # (lookup, depth) -> of those, rounds that accepted it

    def graft_log_prob(self, lookup: str, depth: int) -> float:
        """Log of the chance that a node `lookup` ("context" or "corpus") grafted at `depth` is accepted, learned so
        far ((hits + 1) / (rounds + 2)). Frozen, a depth it never saw (a file calibrated with lookup 7, decoding
        with 12) takes the chance of the deepest depth it saw above that one, not the prior's 1/2: acceptance only
        falls with depth (a depth above every seen one keeps the prior)."""
        key = (lookup, depth)
        if self.frozen and not self.graft_rounds.get(key):
            seen = [d for (name, d), rounds in self.graft_rounds.items() if name == lookup and d < depth and rounds]
            key = (lookup, max(seen)) if seen else key
        return math.log((self.graft_accepted.get(key, 0) + 1) / (self.graft_rounds.get(key, 0) + 2))

    def observe_graft(self, lookup: str, grafted_depths: list[int], path: list[int], accepted: list[int]) -> None:
        """A verified round in which `lookup` grafted nodes at `grafted_depths` of its `path`, and the target
        accepted the draft tokens `accepted`."""
        if self.frozen:
            return
        matched = 0
        while matched < min(len(path), len(accepted)) and path[matched] == accepted[matched]:
            matched += 1
        for depth in grafted_depths:
            key = (lookup, depth)
            self.graft_rounds[key] = self.graft_rounds.get(key, 0) + 1
            self.graft_accepted[key] = self.graft_accepted.get(key, 0) + (matched >= depth)

    @staticmethod
    def shape(method: str, budget: int) -> int | None:
        """What a temperature is kept for: the ddtree budget, or None for the chain."""
        return budget if method == "ddtree" else None

    def log_temperature(self, shape: int | None) -> float:
        if shape in self.log_temperatures or shape is None:
            return self.log_temperatures.get(shape, 0.0)
        budgets = [b for b in self.log_temperatures if b is not None]
        return self.log_temperatures[min(budgets, key=lambda b: (abs(b - shape), b))] if budgets else 0.0

    def temperature(self, shape: int | None) -> float:
        return math.exp(self.log_temperature(shape))

    def observe(self, shape: int | None, expected: float, accepted_length: int) -> None:
        if self.frozen or not math.isfinite(expected):  # a NaN would clamp to the floor: max(-2, nan) is -2
            return
        log_t = self.log_temperature(shape) + self.RATE * (expected - accepted_length)
        self.log_temperatures[shape] = min(self.LOG_LIMIT, max(-self.LOG_LIMIT, log_t))
        if self.trajectory is not None:
            self.trajectory.setdefault(shape, []).append(self.log_temperatures[shape])

    def observe_round(self, shape: int | None, tree, expected: float, grafted: list[int], quoted: list[int],
                      accepted: list[int]) -> None:
        """A verified round (generate's, or training/replay.py's): the drafted `tree` (a DraftTree) expected
        `expected` and the target accepted the draft tokens `accepted`; grafted and quoted: the context and corpus
        lookups' paths, whose nodes tell how deep the target followed each lookup."""
        if not len(tree):
            return
        self.observe(shape, expected, 1 + len(accepted))
        if tree.grafted:
            self.observe_graft("context", tree.grafted, grafted, accepted)
        if tree.quoted:
            self.observe_graft("corpus", tree.quoted, quoted, accepted)

    def settled(self) -> OnlineCalibration:
        """A frozen copy whose log temperatures are the mean over the last half of the recorded rounds.

        The last step alone is noisy: each round moves log T by RATE x an error of about one token, so it wanders
        by ~0.1 around where expected and measured agree; frozen at its end, a calibration run on the 40 held-out
        prompts expected 0.10 less than it then measured on them. The average over the rounds after it settled
        (the first half is its way there) is what a fixed temperature should be (Polyak-Ruppert averaging).
        """
        settled = self.copy(frozen=True)
        for shape, path in (self.trajectory or {}).items():
            settled.log_temperatures[shape] = sum(path[len(path) // 2:]) / len(path[len(path) // 2:])
        return settled

    def describe(self) -> str:
        """The temperatures it holds, for a line on stderr: ddtree@32 1.14, chain 1.15."""
        return ", ".join(f"{'chain' if shape is None else f'ddtree@{shape}'} {self.temperature(shape):.2f}"
                         for shape in self.log_temperatures) or "none"

    def copy(self, frozen: bool = False) -> OnlineCalibration:
        """What it holds, to go on learning from (online calibration that starts from a file) or to use frozen."""
        other = OnlineCalibration(frozen)
        other.log_temperatures = dict(self.log_temperatures)
        other.graft_rounds, other.graft_accepted = dict(self.graft_rounds), dict(self.graft_accepted)
        return other

    def state(self) -> dict:
        """As calibration.json holds it: JSON keys and [accepted, rounds] pairs."""
        grafts: dict[str, dict[str, list[int]]] = {}
        for (lookup, depth), rounds in sorted(self.graft_rounds.items()):
            grafts.setdefault(lookup, {})[str(depth)] = [self.graft_accepted.get((lookup, depth), 0), rounds]
        shapes = sorted(self.log_temperatures, key=lambda shape: (shape is None, shape or 0))  # budgets, then the chain
        temperatures = {CHAIN if shape is None else str(shape): round(self.temperature(shape), 6) for shape in shapes}
        return {"temperatures": temperatures, "graft_acceptance": grafts}

    @classmethod
    def from_state(cls, state: dict) -> OnlineCalibration:
        """The inverse of state(), frozen, and the settings it was learned with where the state says (decoded_with);
        ValueError names the first entry that is not what state() writes."""
        if not isinstance(state, dict):
            raise ValueError(f"it holds {json.dumps(state)[:40]}, not a JSON object")
        for field in ("temperatures", "graft_acceptance"):
            if field not in state:  # a bare KeyError said only the name
                raise ValueError(f"missing field {field}")
            if not isinstance(state[field], dict):
                raise ValueError(f"{field} {state[field]!r} is not an object")
        calibration = cls(frozen=True)
        decoded_with = state.get("decoded_with")
        if decoded_with is not None and not isinstance(decoded_with, dict):  # else a TypeError in differences()
            raise ValueError(f"decoded_with {decoded_with!r} is not an object of the lookup, redraft and corpus it was "
                             "learned with")
        calibration.decoded_with = decoded_with
        for key, temperature in state["temperatures"].items():
            plain = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            if not (plain and math.isfinite(temperature) and temperature > 0
                    and abs(math.log(temperature)) <= cls.LOG_LIMIT + 1e-4):  # state() rounds to 6 places
                raise ValueError(f"temperature {key}: {temperature!r} is not a number within e^-2..e^2")
            calibration.log_temperatures[None if key == CHAIN else _positive(key, "budget")] = math.log(temperature)
        for lookup, depths in state["graft_acceptance"].items():
            if lookup not in LOOKUPS:  # a misspelt one's table would never be read: its nodes would score the prior
                raise ValueError(f"graft_acceptance {lookup!r} is not a lookup: {' or '.join(LOOKUPS)}")
            if not isinstance(depths, dict):
                raise ValueError(f"graft_acceptance {lookup} {depths!r} is not an object of depths")
            for depth, counts in depths.items():
                if not (isinstance(counts, list) and len(counts) == 2 and all(type(n) is int for n in counts)
                        and 0 <= counts[0] <= counts[1]):
                    raise ValueError(f"graft_acceptance {lookup} {depth}: {counts!r} is not [accepted, rounds]")
                key = (lookup, _positive(depth, "depth"))
                calibration.graft_accepted[key], calibration.graft_rounds[key] = counts
        return calibration


def _positive(key: str, what: str) -> int:
    if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
        raise ValueError(f"{what} {key!r} is not a positive whole number")
    return int(key)


def learning_from(shipped: OnlineCalibration | None) -> OnlineCalibration:
    """--online-calibration: learning from what the drafter's calibration file holds, or from a fresh start."""
    return shipped.copy() if shipped is not None else OnlineCalibration()


def weights_fingerprint(folder: Path, samples: int = 16, chunk: int = 1 << 16) -> str | None:
    """A short hash of a drafter folder's weight files, to tell whether a calibration file was learned on them.

    Each file's name and size and `samples` evenly spaced chunks of it (the first holds a safetensors header: the
    names and shapes): 1 MiB read a file, whatever the drafter's size, and training moves every weight, so retrained
    weights copied into the folder change it. None for a folder without weight files."""
    files = sorted(path for pattern in ("*.safetensors", "*.bin") for path in Path(folder).glob(pattern)
                   if path.name != CORPUS_FILE)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            for i in range(samples):
                f.seek(i * max(size - chunk, 0) // (samples - 1))
                digest.update(f.read(chunk))
    return digest.hexdigest()[:16]


def save_calibration(path: Path, calibration: OnlineCalibration, facts: dict) -> None:
    """calibration.json: what it learned, and `facts` (the prompts, the settings, what it measured) beside it."""
    write_json_atomic(path, {"format_version": FORMAT_VERSION, **calibration.state(), **facts})


def load_calibration(path: Path, leave_out: str = "--calibration none") -> OnlineCalibration:
    """A calibration file, frozen; a broken one is one DDTreeError line naming it. `leave_out` says how the caller
    decodes without it (a Decoder's calibration=False)."""
    try:
        state = json.loads(Path(path).read_text())
        if isinstance(state, dict) and state.get("format_version") != FORMAT_VERSION:  # (anything else: from_state)
            raise ValueError(f"format_version {state.get('format_version')!r}, this code reads {FORMAT_VERSION}")
        calibration = OnlineCalibration.from_state(state)
        calibration.weights = state.get("weights")  # the fingerprint of the weights it was learned on
        # a file written before decoded_with held the sampling and dtype has them beside it
        beside = {name: state[name] for name in ("temperature", "dtype") if name in state}
        calibration.decoded_with = {**beside, **(calibration.decoded_with or {})} or None
        return calibration
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as error:
        raise DDTreeError(f"calibration file {path} cannot be read ({error}); rerun `ddtree calibrate` with "
                          f"--overwrite, or decode with {leave_out}") from None


def note_in_card(folder: Path, created: str) -> bool:
    """Say in the card of an export (its README.md, which ends in REPO_MARK) that the folder's calibration file came
    after the card's figures: `ddtree` decodes with it by default, and the card said the figures were what `ddtree`
    decodes this drafter to (found in a review: 2.938 calibrated against the card's 2.984). The paragraph closes the
    card's section of figures and is replaced by a later calibrate's. False, and nothing written, for a folder
    without such a card (a README.md of the user's own is theirs)."""
    card = Path(folder) / "README.md"
    try:
        lines = card.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):  # none, or not an export's
        return False
    if not any(line.startswith(REPO_MARK) for line in lines):
        return False
    note = (f"{CARD_NOTE} `ddtree calibrate` wrote `{CALIBRATION_FILE}` into this folder on {created}, after the "
            "figures of this card were measured without it. `ddtree` decodes with it by default, which reshapes the "
            "draft trees (never the output), so the tau it gives may differ from these: decode with `--calibration none` "
            f"to reproduce them. `{CALIBRATION_FILE}` holds the prompts and settings it learned on.")
    noted = next((i for i, line in enumerate(lines) if line.startswith(CARD_NOTE)), None)
    if noted is not None:
        lines[noted] = note
    else:
        start = next((i for i, line in enumerate(lines) if line == MEASURED_SECTION), None)
        end = next((i for i, line in enumerate(lines) if line.startswith(REPO_MARK)))
        if start is not None:  # before the next section, else before the mark
            end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), end)
        lines[end:end] = [note, ""]
    write_text_atomic(card, "\n".join(lines) + "\n")
    return True

"""Pushing an exported drafter folder to the Hugging Face Hub, and the checks that come before it.

    check_repo_id("you/smollm2-135m-dflash")       # before any work: a bad name costs nothing
    api, endpoint = preflight_hub(repo, private)   # token, network and visibility, before exporting
    url = push(api, endpoint, folder, repo, private=False, replace=False)

The token is HF_TOKEN, else the one `hf auth login` saved; the endpoint is HF_ENDPOINT, read at
call time. Every failure is one DDTreeError line; a failed upload leaves the export folder
intact, and its line gives the command that retries it: `python -m training.publish --push-only FOLDER --repo REPO`
with the push's --private and --replace-repo.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import BadRequestError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from ddtree.calibration import CARD_NOTE
from ddtree.corpus import CORPUS_FILE
from ddtree.drafters import check_weights_match_config, read_drafter_config
from ddtree.errors import DDTreeError, error_line
from ddtree.files import is_download_extra
from ddtree.names import CALIBRATION_FILE
from ddtree.targets import has_hub_id_shape

from .engines import ARCHITECTURE, weight_shapes
from .hub_config import EXPORT_FILES
from .model_card import CORPUS_SHIPPED, MEASURED_TABLE, REPO_MARK, card_repo


# What a repo that an earlier push of a drafter export filled can hold (the Hub adds .gitattributes; `ddtree calibrate`
# writes its temperatures beside a drafter).
EXPORT_NAMES = {*EXPORT_FILES, CORPUS_FILE, CALIBRATION_FILE, ".gitattributes"}

# A Hub license id as the card's metadata takes it: lowercase, like apache-2.0, llama3.1, openrail++ or other.
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")


def check_hub_id(value: str, name: str, why: str, owner: bool = True) -> None:
    """A Hub model id: the Hub's character rules, then ddtree's owner/name shape (owner=False: a Hub id may also be
    a bare name, as the oldest models are: gpt2). name: how the user gave it (REPO=, --base-model); why: what for."""
    try:
        validate_repo_id(value)
    except HFValidationError as error:
        raise DDTreeError(f"{name}{value!r} is not a valid Hub repo id ({error_line(error)})") from None
    # The shape alone: it always names a Hub repo, even where a local folder has the same name (an export
    # written to OUT=you/name is pushed to REPO=you/name).
    if owner and not has_hub_id_shape(value):
        raise DDTreeError(f"{name}{value!r} must be user/name or org/name (not a local path), {why}")


def check_repo_id(repo: str) -> None:
    check_hub_id(repo, "REPO=", "so the drafter lands in your namespace")


def check_card_fields(base_model: str | None, license_id: str) -> None:
    """--base-model and --license go into the model card's metadata, which the Hub validates on push."""
    if base_model is not None:
        check_hub_id(base_model, "--base-model ", "the target's id on the Hub, which the card links", owner=False)
    if not LICENSE_ID.fullmatch(license_id):
        raise DDTreeError(f"--license {license_id!r} is not a Hub license id: give one in lowercase, such as "
                          "apache-2.0, mit, llama3.1 or other (match the target's)")


def check_export_folder(folder: Path, repo: str) -> None:
    """--push-only: the folder must be a finished export of a drafter (training/publish.py writes every file or none),
    and its card written for `repo`. The push makes the repo hold exactly the folder's files, so any other folder
    would replace what the repo served; and a card exported for another repo (or none) tells readers to download
    and serve that one. A calibration.json the card does not mention (ddtree.calibration.note_in_card) would make the
    card's figures read as what `ddtree` decodes the pushed drafter to, which it does calibrated; a card that mentions
    one the folder does not hold would describe a file the repo lacks. The corpus likewise: a card whose figures were
    measured grafting the corpus.safetensors it says the folder ships, pushed without it, reports what `ddtree` no
    longer decodes the pushed drafter to; one put into a folder whose card's figures were measured without it changes
    how `ddtree` decodes."""
    missing = [name for name in EXPORT_FILES if not (folder / name).is_file()]
    if missing:
        raise DDTreeError(
            f"--push-only {folder}: not a finished export (missing {', '.join(missing)}); export it first"
        )
    # upload_folder sends every file but .git/ and .cache/huggingface/ (huggingface_hub's default ignore patterns),
    # and the next push would then refuse the repo for holding them (check_repo_holds_an_export); what a download
    # writes beside an export (DOWNLOAD_EXTRAS) is also what --overwrite replaces it with (ddtree/files.py)
    files = (path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    foreign = sorted(name for name in files if name not in EXPORT_NAMES and not is_download_extra(name)
                     and not (name == ".git" or name.startswith(".git/")))
    if foreign:
        raise DDTreeError(f"--push-only {folder}: holds files no drafter export writes ({shown_names(foreign)}), which "
                          "the push would upload as the drafter's; move them out of the folder")
    try:
        config = json.loads((folder / "config.json").read_text())
        shapes = weight_shapes(folder)
    except (OSError, UnicodeDecodeError, ValueError, DDTreeError) as error:
        raise DDTreeError(f"--push-only {folder}: not an export of a drafter ({error_line(error)}); "
                          "export it again (make export)") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or ARCHITECTURE not in architectures:
        raise DDTreeError(f"--push-only {folder}: not an export of a drafter (config.json's architectures is "
                          f"{architectures!r}, not [{ARCHITECTURE!r}]); export it with make export")
    if not shapes:
        raise DDTreeError(f"--push-only {folder}: not an export of a drafter (model.safetensors holds no tensor); "
                          "export it with make export")
    try:  # a config.json edited over the exported weights: `ddtree` refuses the folder, AutoModel starts what is
        # missing from random values, and the push would replace what the repo served with it
        check_weights_match_config(folder, read_drafter_config(folder))
    except DDTreeError as error:
        raise DDTreeError(f"--push-only {folder}: {error}") from None
    card = (folder / "README.md").read_text(errors="replace")
    written_for = card_repo(card)
    if written_for != repo:
        names = f"the repo {written_for}" if written_for else "no Hub repo (path/to/this/folder)"
        elsewhere = f", or push it to {written_for}" if written_for else ""
        raise DDTreeError(f"--push-only {folder}: its card (README.md) was written for {names}, whose name its usage "
                          f"and serve commands give; export again with --repo {repo} (REPO={repo}){elsewhere}")
    calibrated = (folder / CALIBRATION_FILE).is_file()
    if calibrated and CARD_NOTE not in card:  # put there by hand, or by an older calibrate
        raise DDTreeError(f"--push-only {folder}: holds {CALIBRATION_FILE}, which ddtree decodes with by default, and its "
                          "card (README.md), whose figures were measured without it, does not say so: run `ddtree "
                          "calibrate --overwrite` on the folder again, which notes it in the card, or move "
                          f"{CALIBRATION_FILE} out of the folder (a card's `{CARD_NOTE}` paragraph goes with it)")
    if not calibrated and CARD_NOTE in card:  # calibrated, then the file moved out
        raise DDTreeError(f"--push-only {folder}: its card (README.md) says in its `{CARD_NOTE}` paragraph that "
                          f"`ddtree calibrate` wrote {CALIBRATION_FILE} into this folder, which does not hold it: put "
                          f"{CALIBRATION_FILE} back, or delete that paragraph from the card to push the drafter "
                          "uncalibrated")
    with_corpus = (folder / CORPUS_FILE).is_file()
    if not with_corpus and CORPUS_SHIPPED in card:  # removed from the export, the replies not to be published, say
        raise DDTreeError(f"--push-only {folder}: its card (README.md) says its figures were measured grafting "
                          f"{CORPUS_FILE}, shipped in this folder, which does not hold it: `ddtree` would decode the "
                          f"pushed drafter without it, at a tau the card does not report. Put {CORPUS_FILE} back; to "
                          "publish a drafter without its training replies, train it without model.corpus")
    if with_corpus and MEASURED_TABLE in card and CORPUS_SHIPPED not in card:  # put there by hand, say
        raise DDTreeError(f"--push-only {folder}: holds {CORPUS_FILE}, which ddtree grafts from by default, and its "
                          "card (README.md), whose figures were measured without it, does not say so: move "
                          f"{CORPUS_FILE} out of the folder to push the drafter as it was measured")


def hub_error_line(error: BaseException, token: str | None) -> str:
    """A Hub client's error as one line, every line of its message joined (its first line alone can be a heading, as
    "Invalid metadata in README.md." before the reason), without the token: the client's messages can quote the
    Authorization header it sent (a header it refused to send, say), and the line goes to stderr and into CI logs."""
    line = " ".join(part.strip() for part in str(error).splitlines() if part.strip()) or error_line(error)
    if token:
        line = line.replace(token, "<HF_TOKEN>")
    # the token as the message escaped it; a bracket or comma after it is the message's ("(Bearer hf_x)")
    return re.sub(r"Bearer [^\s'\"(),;]+", "Bearer <HF_TOKEN>", line)


def hub_endpoint() -> str:
    # Read at call time (huggingface_hub reads HF_ENDPOINT once, at import).
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


HUB_TIMEOUT_S = 15.0  # for the preflight's first answer; huggingface_hub's own client waits without a deadline


def check_hub_answers(endpoint: str) -> None:
    """One plain request with a deadline before the Hub client's first call, which has none: a Hub or proxy that
    accepts the connection and never answers would otherwise hang the push forever. Any HTTP answer will do."""
    try:
        urllib.request.urlopen(f"{endpoint}/api/whoami-v2", timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return  # it answered (401 to a request without the token)
    except (OSError, ValueError, http.client.HTTPException) as error:  # refused, unreachable, timed out, not a URL,
        # or not HTTP at all (HF_ENDPOINT naming another service's port)
        raise DDTreeError(f"--push: cannot use the Hub at {endpoint} ({error_line(error)}; waited at most "
                          f"{HUB_TIMEOUT_S:.0f} s for an answer); check the network and HF_ENDPOINT") from None


def offline_variable() -> str | None:
    """The variable that keeps huggingface_hub offline as the environment is now, read by the client's rule:
    HF_HUB_OFFLINE where it is set (it decides), else TRANSFORMERS_OFFLINE, which clusters often set for transformers
    alone. None where neither does any more: the client read them once, at import, and stays offline."""
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    value = os.environ.get(name, "")
    return f"{name}={value}" if value.upper() in constants.ENV_VARS_TRUE_VALUES else None


def preflight_hub(repo: str, private: bool = False, replace: bool = False) -> tuple[HfApi, str]:
    """Token and network checked before any work, so a push that cannot happen costs nothing; with `private`,
    that the repo is not already public (a push never changes an existing repo's visibility); unless `replace`,
    that an existing repo holds nothing but an earlier export (a push leaves it holding exactly the export's files)."""
    if constants.HF_HUB_OFFLINE:  # what the client obeys: either variable, as set when the program started
        variable = offline_variable()
        if variable is None:  # unset (or set to 0) since: telling the user to unset it would mislead
            raise DDTreeError("--push: huggingface_hub is offline: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE was set when "
                              "it was imported, and it reads them only then; start again with neither set to push to "
                              "the Hub")
        raise DDTreeError(f"--push: {variable} is set, which keeps huggingface_hub offline; unset it to push to the Hub")
    # huggingface_hub's own reading of HF_TOKEN (else the saved login): it strips the stray newline or space a pasted
    # secret or a CRLF .env file leaves, which the client would otherwise send, and quote, in the header
    try:
        token = get_token()
    except Exception as error:  # noqa: BLE001 - HF_OIDC_RESOURCE set and its token exchange failed
        raise DDTreeError(f"--push: cannot get a Hugging Face token ({hub_error_line(error, None)})") from None
    if not token:
        raise DDTreeError(
            "--push: no Hugging Face token; set HF_TOKEN to a write token (https://huggingface.co/settings/tokens)"
        )
    endpoint = hub_endpoint()
    check_hub_answers(endpoint)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        user = api.whoami()
    except Exception as error:  # noqa: BLE001 - network and HTTP errors alike end here, as one line
        raise DDTreeError(
            f"--push: cannot use the Hub at {endpoint} ({hub_error_line(error, token)}); check the network and HF_TOKEN"
        ) from None
    role = ((user.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise DDTreeError(f"--push: HF_TOKEN is a read-only token of {user.get('name')}; use a write token for {repo}")
    if private:
        try:
            public = not api.repo_info(repo).private
        except RepositoryNotFoundError:
            public = False  # the push creates it private
        except Exception as error:  # noqa: BLE001
            raise DDTreeError(f"--private: cannot read {repo} on the Hub at {endpoint} "
                              f"({hub_error_line(error, token)})") from None
        if public:
            raise DDTreeError(f"--private: {repo} already exists and is public, and a push does not change that; "
                              "make it private in its settings on the Hub first, or drop --private")
    if not replace:
        check_repo_holds_an_export(api, endpoint, repo)
    return api, endpoint


def check_repo_holds_an_export(api: HfApi, endpoint: str, repo: str) -> None:
    """An existing repo that an earlier push filled holds no file an export does not write, and says it is a drafter
    export: its config.json names DFlashDraftModel, or its README.md carries the card's REPO_MARK line. Any other repo
    is not one a push filled (REPO names another repo, by a typo say): the push would delete its files, or replace
    its weights, config and card, which file names alone do not tell from an export's."""
    try:
        files = api.list_repo_files(repo)
    except RepositoryNotFoundError:
        return  # the push creates it
    except Exception as error:  # noqa: BLE001 - network and HTTP errors alike end here, as one line
        raise DDTreeError(f"--push: cannot list the files of {repo} on the Hub at {endpoint} "
                          f"({hub_error_line(error, api.token)})") from None
    replace = ("check REPO, or add --replace-repo (REPLACE_REPO=1) to replace them (the Hub keeps them in the repo's "
               "history)")
    foreign = sorted(set(files) - EXPORT_NAMES)
    if foreign:
        raise DDTreeError(f"--push: {repo} already holds files that no drafter export writes ({shown_names(foreign)}), "
                          f"and a push leaves the repo holding exactly the export's: {replace}")
    held = sorted(set(files) - {".gitattributes"})  # the Hub writes .gitattributes into every new repo
    if not held:
        return
    architectures = None
    if "config.json" in held:
        text = read_repo_file(api, endpoint, repo, "config.json")  # a failed read is its own one line, not "no export"
        try:
            config = json.loads(text)
        except ValueError:
            config = None
        architectures = config.get("architectures") if isinstance(config, dict) else None
        if isinstance(architectures, list) and ARCHITECTURE in architectures:
            return
    if "README.md" in held:
        card = read_repo_file(api, endpoint, repo, "README.md")
        if any(line.startswith(REPO_MARK) for line in card.splitlines()):
            return
    config_says = (f"its config.json's architectures is {architectures!r}, not [{ARCHITECTURE!r}]"
                   if "config.json" in held else "it has no config.json")
    card_says = "its README.md is not a card an export writes" if "README.md" in held else "it has no README.md"
    raise DDTreeError(f"--push: {repo} already holds {shown_names(held)}, not an earlier drafter export "
                      f"({config_says}; {card_says}): {replace}")


def read_repo_file(api: HfApi, endpoint: str, repo: str, name: str) -> str:
    """One small file of a repo on the Hub, through the push's own client (endpoint and token)."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            return Path(api.hf_hub_download(repo, name, local_dir=folder)).read_text(errors="replace")
        except Exception as error:  # noqa: BLE001 - network and HTTP errors alike end here, as one line
            raise DDTreeError(f"--push: cannot read {name} of {repo} on the Hub at {endpoint} "
                              f"({hub_error_line(error, api.token)})") from None


def shown_names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_card_metadata(api: HfApi, endpoint: str, card: str, repo: str, refused: str, unasked: str) -> None:
    """The Hub's own check of a card's metadata (license, base_model, tags), the one upload_folder makes of README.md
    before it commits: a card the Hub refuses fails every push of it, so it is refused before the repo is created
    (and, for an export with --push, before the export is written). `refused` says what to do about a card the Hub
    refuses, `unasked` what to do where the Hub could not be asked."""
    try:
        # HfApi._validate_yaml: what upload_folder calls, at the push's endpoint and with its token (the public
        # ModelCard.validate reads HF_ENDPOINT as it was at import, and sends no token)
        api._validate_yaml(card, repo_type="model")
    except Exception as error:  # noqa: BLE001 - network and HTTP errors alike end here, as one line
        if isinstance(error, ValueError) and isinstance(error.__cause__, BadRequestError):
            # the Hub answered 400: its reasons, one per line
            raise DDTreeError(f"--push: the Hub at {endpoint} refuses the metadata of the card (README.md) for {repo} "
                              f"({hub_error_line(error, api.token)}); {refused}") from None
        # _validate_yaml reads the answer as JSON before it looks at the status: a gateway's or proxy's error page
        # (a 502 in HTML during an outage) is a JSONDecodeError, a ValueError too, and says nothing of the card
        reason = ("its answer is not JSON: an error page, of the Hub or of a proxy on the way"
                  if isinstance(error, json.JSONDecodeError) else hub_error_line(error, api.token))
        raise DDTreeError(f"--push: cannot have the Hub at {endpoint} check the card's metadata for {repo} "
                          f"({reason}); {unasked}") from None


def push(api: HfApi, endpoint: str, folder: Path, repo: str, private: bool, replace: bool) -> str:
    """Upload the folder as one commit that leaves the repo holding exactly its files; return the repo URL.
    `private` and `replace` are the push's --private and --replace-repo, which a failed push's retry command repeats.
    A card whose metadata the Hub refuses is refused first, with no repo created: a retry would send it again."""
    # the same flags: a retry without --private would create the repo with the owner's default visibility
    retry = (f"python -m training.publish --push-only {shlex.quote(str(folder))} --repo {repo}"
             + (" --private" if private else "") + (" --replace-repo" if replace else ""))
    intact = f"the export in {folder} is intact: retry with {retry}"
    check_card_metadata(api, endpoint, (folder / "README.md").read_text(errors="replace"), repo,
                        refused="export it again with a --license (LICENSE=) or --base-model (BASE_MODEL=) the Hub "
                                "takes (its reason names the field); nothing was pushed",
                        unasked=f"check the network and HF_TOKEN; {intact}")
    try:
        # Not private=False: that would make it public where the owner's default is private.
        api.create_repo(repo, private=True if private else None, exist_ok=True)
        api.upload_folder(  # the repo's files become the export's: one left from an earlier push (a corpus, say)
            folder_path=folder, repo_id=repo, commit_message="Upload DFlash drafter (training/publish.py)",
            delete_patterns="*",  # would be read as this drafter's (the Hub keeps the history; .gitattributes stays)
        )
    except Exception as error:  # noqa: BLE001 - any upload failure: the export stays for --push-only
        raise DDTreeError(f"upload to {repo} failed ({hub_error_line(error, api.token)}); {intact}") from None
    return f"{endpoint}/{repo}"

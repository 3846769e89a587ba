"""Configuration of the block-diffusion (DFlash) drafter.

A Qwen3 configuration plus the published DFlash fields that clients read:
`block_size`, `num_target_layers` and `dflash_config = {mask_token_id, target_layer_ids}`.
Its model_type is Qwen3's, as in the published DFlash drafters: the drafter's layers are Qwen3's,
so `AutoConfig.from_pretrained(folder)` reads a saved drafter without remote code (a Qwen3Config
that keeps every DFlash field), vLLM and SGLang read it as they read the published ones, and the
reference `dflash.DFlashDraftModel` loads the same folder. This file ships to the Hub as remote
code: it imports transformers only.
"""

from transformers import Qwen3Config

# model_type of drafters saved before it became Qwen3's; they still load, read as "qwen3".
LEGACY_MODEL_TYPE = "dflash_drafter"


# How many target layers a drafter reads when nothing says otherwise (published: 5; "5 target layers beat 3").
DEFAULT_NUM_TARGET_FEATURES = 5


def default_target_layer_ids(num_target_layers: int, num_features: int = DEFAULT_NUM_TARGET_FEATURES) -> list[int]:
    """`num_features` target layers spread uniformly from the 2nd to the 3rd-from-last.

    Layer id l is the output of decoder layer l (hidden_states[l + 1] in transformers' tuple).
    For a 36-layer target and 5 features: [1, 9, 17, 25, 33].
    """
    if num_features == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (num_features - 1)) for i in range(num_features)]


def _decoding_default(key: str, doc: str) -> property:
    """A count decoders use unless told otherwise, kept in dflash_config only when set (0 = absent, as before it)."""

    def get(self) -> int:
        return int(self.dflash_config.get(key, 0))

    def set(self, value: int) -> None:
        if value:
            self.dflash_config[key] = int(value)
        else:
            self.dflash_config.pop(key, None)

    return property(get, set, doc=doc)


class DFlashDrafterConfig(Qwen3Config):
    model_type = "qwen3"  # not a type of its own: what the engines and AutoConfig read without remote code

    def __init__(
        self,
        block_size: int = 16,  # anchor + (block_size - 1) drafted tokens per forward
        num_target_layers: int | None = None,  # depth of the target the drafter was built for
        dflash_config: dict | None = None,  # {"mask_token_id": int, "target_layer_ids": [int, ...]}
        target_name_or_path: str | None = None,  # informational: which target it was trained against
        **kwargs,
    ):
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dict(dflash_config or {})
        # vLLM's speculators format repeats the MASK id at the top level: the same field, kept in dflash_config.
        top_level_mask_token_id = kwargs.pop("mask_token_id", None)
        if top_level_mask_token_id is not None:
            self.dflash_config.setdefault("mask_token_id", top_level_mask_token_id)
        self.target_name_or_path = target_name_or_path
        # The layers are Qwen3's and rotate their whole head. A partial_rotary_factor (which drafters of partial-rotary
        # targets, StableLM or GPT-NeoX, copied from them before ddtree/targets.py dropped it) is dropped: under the
        # default RoPE transformers ignored it too, and under a scaled one the first forward failed on it.
        kwargs.pop("partial_rotary_factor", None)
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = {name: value for name, value in kwargs[key].items() if name != "partial_rotary_factor"}
        kwargs.pop("model_type", None)  # the class's; a saved one (LEGACY_MODEL_TYPE too) must not shadow it
        kwargs.setdefault("architectures", ["DFlashDraftModel"])
        super().__init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == LEGACY_MODEL_TYPE:
            # A drafter saved before model_type became Qwen3's: the same fields, so no "wrong type" warning.
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def draft_temperatures(self) -> list[float] | None:
        """Per drafted position 1..B-1, the temperature its logits are divided by before a tree is built.

        Fitted on held-out data so the drafter's probabilities are calibrated (training/module.py,
        `calibrate`): the best-first tree ranks its nodes by them and its expected acceptance is their
        sum. None (every drafter without calibration) means 1. Argmax, so the chain, is unchanged. Decoders apply
        them whatever `--calibration` says (`none` too): they are part of the drafter, as its weights are.
        """
        return self.dflash_config.get("draft_temperatures")

    @draft_temperatures.setter
    def draft_temperatures(self, temperatures: list[float] | None) -> None:
        if temperatures is None:
            self.dflash_config.pop("draft_temperatures", None)
        else:
            self.dflash_config["draft_temperatures"] = [float(t) for t in temperatures]

    @property
    def draft_vocab(self) -> list[int] | None:
        """The token ids the drafter may propose, ascending, or None (every row of the target's LM head).

        Chosen at training as the reply tokens seen most often (training/module.py, draft_vocab_size):
        the LM head over a 49K-150K vocabulary is the drafter's largest matmul, and a few thousand
        tokens carry almost every reply token. Other tokens get probability 0 (`compute_logits`);
        decoding stays lossless, since the target verifies every draft.
        """
        return self.dflash_config.get("draft_vocab")

    @draft_vocab.setter
    def draft_vocab(self, token_ids: list[int] | None) -> None:
        if token_ids is None:
            self.dflash_config.pop("draft_vocab", None)
        else:
            self.dflash_config["draft_vocab"] = sorted(int(t) for t in token_ids)

    redraft = _decoding_default(
        "redraft",
        """How many depth-1 tokens decoders re-draft behind by default (`--redraft`; ddtree/decoding.py).

        Set for drafters trained with model.redraft_prob, which learned to continue a block behind a given first
        token; 0 (every other drafter) means one draft per round.
        """,
    )
    lookup = _decoding_default(
        "lookup",
        """How many tokens of context lookup decoders graft into every tree by default (`--lookup`; ddtree/tree.py).

        Set by a recipe's model.lookup where it was measured to pay (docs/decoding.md, Context lookup); 0 = the drafter's
        trees alone.
        """,
    )

    @property
    def calibration(self) -> dict | None:
        """What model.replay_calibration learned by replaying tree decoding over the validation replies (a draft
        temperature per tree shape, each lookup's acceptance by depth; OnlineCalibration.state()), and the lookup,
        re-drafting and corpus it replayed with (decoded_with, as in calibration.json), or None.

        Decoders use it frozen by default, as they use a folder's calibration.json (which `ddtree calibrate` fits on
        the prompts served, and which comes first); `--calibration none` leaves both out.
        """
        return self.dflash_config.get("calibration")

    @calibration.setter
    def calibration(self, state: dict | None) -> None:
        if state is None:
            self.dflash_config.pop("calibration", None)
        else:
            self.dflash_config["calibration"] = state

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids is None and self.num_target_layers is not None:
            ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return list(ids or [])

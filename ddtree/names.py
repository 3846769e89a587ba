"""Names the library and the `ddtree` command's parser share, in a module free of torch and transformers: the parser
(ddtree/arguments.py) answers --help and a bad flag before those load (about 8 s on the 2-core EPYC)."""

METHODS = ("ar", "dflash", "ddtree")  # decoding methods; dflash is the DFlash chain
PACKED_KERNELS = ("auto", "on", "off")  # --packed-weights
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what a --dtype or a recipe's dtype field can name (ddtree/targets.py)
AUTO = "auto"  # --dtype auto: bf16 where this machine computes it fast (measured on a CPU), else float32 (ddtree/precision.py)
CALIBRATION_FILE = "calibration.json"  # in a drafter folder: what `ddtree calibrate` learned
CORPUS_FILE = "corpus.safetensors"  # in a run folder and in its drafter exports: the replies' token ids
# A drafter export's card (README.md) ends with this line, naming the Hub repo it was written for ("none": a local
# export): training/model_card.py writes it, --push-only checks it, and `ddtree calibrate` tells an export's card by it.
REPO_MARK = "<!-- ddtree export, written for the Hub repo: "

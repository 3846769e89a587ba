#!/usr/bin/env bash
# Stage DeepSpeed for the GPU machine, whose image lacks it (issue 10: ZeRO-2 trained, saved, resumed and consolidated
# on CUDA), into .gpu-c/ (git-ignored) of this checkout. Run it here, on the CPU machine, after `make setup`:
#
#   recipes/gpu_stage_deepspeed.sh            # .gpu-c/wheels: about 5 MB, beside .gpu-b's 54 MB in one call's carry
#
# deepspeed has no wheel on the package index, only an sdist; its wheel is built here from that sdist with no compiled
# ops (DS_BUILD_OPS=0: ZeRO-2 with the module's own torch AdamW needs none), at requirements.txt's pin. Its imports
# that the GPU image may lack come beside it as Python 3.12 wheels, at the versions this checkout's venv runs; what
# the image does have (torch, numpy, packaging, tqdm, psutil through lightning and peft) is not carried.
# On the GPU machine `recipes/gpu_session.sh zero` installs them into /tmp/site (../shared/GPU.md's staging), e.g.
#   call 1, carry [".gpu-a"]:           mkdir -p /tmp/keep && cp .gpu-a/* /tmp/keep/
#   call 2, carry [".gpu-b", ".gpu-c"]: . .gpu-b/on-device.sh && recipes/gpu_session.sh zero
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: $root/.venv is missing: run make setup first" >&2; exit 2; }
grep -qxF /.gpu-c/ .git/info/exclude 2>/dev/null || echo /.gpu-c/ >> .git/info/exclude

pin=$(grep -E '^deepspeed==' requirements.txt) || { echo "error: requirements.txt pins no deepspeed==VERSION" >&2; exit 2; }
imports="einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection typing-extensions"
pins=$(for name in $imports; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") \
    || { echo "error: $name is not in .venv; run make setup" >&2; exit 2; }
  echo "$name==$version"
done)

rm -rf .gpu-c; mkdir -p .gpu-c/wheels
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .gpu-c/wheels "$pin" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-c/wheels $pins 2>&1 | grep -v "^WARNING: Location" || true
for name in deepspeed $imports; do  # a failed build or download was printed above; name what is missing
  file=$(echo "$name" | tr - _)
  ls .gpu-c/wheels/"$file"-*.whl >/dev/null 2>&1 || { echo "error: no wheel of $name in .gpu-c/wheels" >&2; exit 1; }
done
echo "$pin" > .gpu-c/deepspeed.pin
du -sh .gpu-c; ls .gpu-c/wheels

# Sourced at the start of a GPU benchmark run on the lent machine: installs the carried wheels
# (.whl/, e.g. liger-kernel) and this project (no network there), and sets the environment.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD:$PWD/..:${PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
set +e

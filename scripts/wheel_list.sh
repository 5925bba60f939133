# Sourced by scripts/tpu_wheels.sh and scripts/torch_tpu_parts.sh: keep in a download folder exactly the wheels of a
# pinned list (a wheel left from another version would be installed beside them).
#
#   keep_listed_wheels OWNER DEST SPEC...   SPEC: name==version; OWNER names the caller in its errors
#
# Fails (exit 1) where a listed wheel is missing; removes every other file of DEST but its `parts` folder; sets
# KEPT_WHEELS to the count kept.
keep_listed_wheels() {
    local owner=$1 dest=$2
    shift 2
    local keep=() spec name version stem match f base
    for spec in "$@"; do
        name=${spec%%==*}
        version=${spec#*==}
        stem=$(echo "$name" | tr '-' '_' | tr '[:upper:]' '[:lower:]')
        match=$(find "$dest" -maxdepth 1 -iname "${stem}-${version}-*.whl" | head -1)
        [ -n "$match" ] || { echo "$owner: no wheel of $spec in $dest" >&2; exit 1; }
        keep+=("$(basename "$match")")
    done
    for f in "$dest"/*; do
        base=$(basename "$f")
        [ "$base" = parts ] && continue
        printf '%s\n' "${keep[@]}" | grep -qxF "$base" || { echo "removing $base (not in the list)"; rm -f "$f"; }
    done
    KEPT_WHEELS=${#keep[@]}
}

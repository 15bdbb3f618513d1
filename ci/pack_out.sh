# Sourced by the ci/gpu_*.sh scripts: pack_out DIR NAME... moves every file under DIR except the
# named ones (paths relative to DIR) into DIR/logs.tar.gz, so that a run's results come back
# from a host that returns only a few files per call. PACK_LOGS=0 leaves DIR as it is.
pack_out() {
  local dir="$1"; shift
  [[ "${PACK_LOGS:-1}" == 1 ]] || return 0
  local keep=("$@" logs.tar.gz) args=() name
  for name in "${keep[@]}"; do args+=(! -path "./$name"); done
  (cd "$dir" && find . -type f "${args[@]}" -print0 | tar --null -czf logs.tar.gz --remove-files -T - \
    && find . -mindepth 1 -type d -empty -delete)
  echo "logs packed into $dir/logs.tar.gz (PACK_LOGS=0 keeps them loose)"
}

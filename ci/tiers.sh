# Sourced by the GPU scripts: a pytest command for one tier of ci/tiers.py, the one tier table.
#
#   source ci/tiers.sh
#   tier_command cmd gpu packages/nsa-kernels/tests/selected   # cmd=(env ... python -m pytest ...)
#   timeout 300 "${cmd[@]}" -q -x
#
# The command sets the tier's environment, uses $PYTHON (default python3), and selects the tier's
# tests inside every folder or file given (its marker expression and extra arguments included).

tier_command() {  # ARRAY_NAME TIER FOLDER [FOLDER ...]
  local -n _tier_cmd="$1"
  local root args envs
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  args="$(python3 "$root/ci/tiers.py" args "$2" --under "${@:3}")" || return 2
  envs="$(python3 "$root/ci/tiers.py" env "$2")" || return 2
  local -a arg_list env_list=()
  mapfile -t arg_list <<<"$args"
  [[ -n "$envs" ]] && mapfile -t env_list <<<"$envs"
  _tier_cmd=(env "${env_list[@]}" "${PYTHON:-python3}" -m pytest "${arg_list[@]}")
}

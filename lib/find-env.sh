# shellcheck shell=bash
# Sourced by submit.sh and download_data_model.sh: find and source the env.sh that setup.sh
# wrote. Looks at $LLMTRAIN_HOME, then $SHARED_DIR/$PROJECT_NAME, then the home setup.sh
# recorded in the repo (.llmtrain-home), then the default layout. Needs REPO and die().
load_env() {
  local home="${LLMTRAIN_HOME:-}"
  if [[ -z "$home" && -n "${SHARED_DIR:-}" ]]; then home="$SHARED_DIR/${PROJECT_NAME:-llmtrain}"; fi
  if [[ -z "$home" && -f "$REPO/.llmtrain-home" ]]; then home="$(<"$REPO/.llmtrain-home")"; fi
  home="${home:-$REPO/workspace/llmtrain}"
  [[ -f "$home/env.sh" ]] || die "no llmtrain environment in $home; run: bash setup.sh"
  # shellcheck source=/dev/null
  source "$home/env.sh"
}

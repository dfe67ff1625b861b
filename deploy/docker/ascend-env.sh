#!/bin/bash
# llmesh-ascend-env: load the CANN toolkit (and ATB, when present) environment that
# torch-npu and vllm-ascend need, then exec the given command (llmesh worker ...).
# The toolkit's set_env.sh reads unset variables, so no `set -u` here.
set -e
# shellcheck disable=SC1091
source /usr/local/Ascend/ascend-toolkit/set_env.sh
if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then
    # shellcheck disable=SC1091
    source /usr/local/Ascend/nnal/atb/set_env.sh
fi
exec "$@"

#!/usr/bin/env bash
# Cloud TPU pod slice recipe. NOT RUN HERE: this project has no TPU; the command is documented
# and the train step's lowering for TPU is checked on CPU (launch/lower_step.py --platform tpu).
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a REPO=~/jtree launch/tpu_pod.sh --config configs/qwen3_8b.yaml
#
# Every worker VM runs the same command; JTREE_DISTRIBUTED=auto lets jax.distributed.initialize()
# discover the slice (process count, ids, coordinator) from the TPU metadata. The mesh is
# data x model over all chips (mesh.model from the config, tensor parallel inside a host).
# Data and checkpoint paths must be visible to every worker (e.g. a GCS-fuse mount).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${REPO:?set REPO (checkout on every worker)}"
# The remote command is one string run by the workers' shell: every argument is quoted for it
# (printf %q), so an override holding spaces or shell characters arrives as the one argument it was.
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "cd $(printf %q "$REPO") && JTREE_DISTRIBUTED=auto python -m jtree.launch.train$args"

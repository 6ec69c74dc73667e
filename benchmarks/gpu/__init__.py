"""The GPU benchmarks, run on a GPU node as `python -m benchmarks.gpu.X` (campaign.sh)."""

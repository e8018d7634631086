"""GPU benchmark: throughput and MFU of densebatch against Hugging Face Trainer on one CUDA device (run gpu.sh)."""

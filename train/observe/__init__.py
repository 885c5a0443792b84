"""What a run reports: metrics sinks, W&B, console text, throughput/MFU, measured memory."""

"""FFN's training preprocessing: partitions of the ground truth and balanced seed coordinates."""

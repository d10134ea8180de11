"""The optimiser: stage partitions, token slices and micro-batches (TeraPipe's DP), and the
search over meshes, partitions, slicings and schedules by simulated step time."""

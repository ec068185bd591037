"""A run's life on disk, in its output directory:

output_dir.py    the lock, what an earlier run left there, results files, copies of the code that ran
record.py        what a checkpoint records of its run, and what a resumed run must agree with
checkpoints.py   Orbax checkpoints saved in the background, the newest intact one restored, stop on a signal
checksums.py     checksums of the files a run reads again (checkpoints, packed shards)
tracking.py      the training log and the trackers (TensorBoard, Weights & Biases, MLflow)
"""

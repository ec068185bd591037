"""What the pretraining scripts share: the Flax models and their Hugging Face layout (models/), the arguments and
their checks, reading texts and packed corpora, processes and the device mesh, the output directory, checkpoints,
the training log and trackers, and Hugging Face model directories. The scripts hold what an experiment changes."""

"""Where a run's texts come from and how they are read, and how examples become rows: the data layer's own settings,
which the scripts fill in from their flags."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TextSource:
    """Where a run's texts come from and how they are read: the data flags that name them (the scripts' data
    arguments give theirs, CommonDataArguments.text_source), carried together to every function that reads
    texts."""

    train_file: list[str] | str | None = None
    validation_file: list[str] | str | None = None
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    text_column_name: str = "text"
    text_sample_by: str | None = None  # unset: a .txt file is one document
    keep_linebreaks: bool = True
    skip_missing_texts: bool = False
    cache_dir: str | None = None  # where `datasets` keeps what it reads (its own cache when None)
    token: str | None = None  # the hub token, for private datasets
    # How prompt/completion examples and conversations are read; None where only plain text is (run_mlm_flax.py).
    examples: "ExampleSettings | None" = None

    def text_builder_options(self) -> dict:
        # Unset, a .txt file is one document: the text builder would read no rows at all
        options = {"sample_by": self.text_sample_by or "document", "keep_linebreaks": self.keep_linebreaks}
        if options["sample_by"] == "document":
            # Each document written to Arrow as soon as it is read: `datasets` holds rows that come one at a time
            # (a file read as one document is one) until it has a batch of 1,000, so that converting the files held
            # every document of the corpus in memory at once. The same dataset and fingerprint either way.
            options["writer_batch_size"] = 1
        return options


@dataclass(frozen=True)
class ExampleSettings:
    """How prompt/completion examples and conversations (flax_lm.data.finetune_examples) are read and become rows:
    their columns, the tokens the loss covers, and whether several share a row (run_clm_flax.py's flags of the same
    names)."""

    prompt_column: str | None = None  # None: "prompt"
    completion_column: str | None = None  # None: "completion"
    completion_only_loss: bool = True
    assistant_only_loss: bool = True
    packing: bool = False

"""Local data files: which files --train_file and --validation_file name (paths and globs, resolved by one rule
for every tool), the `datasets` reader of each format, and what identifies their content."""

import glob
import importlib.util
import os

import xxhash

from flax_lm.errors import UsageError
from flax_lm.run.checksums import file_checksum

DATA_FILE_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


# Compressed data files: `datasets` decompresses them as it reads (in files, globs and streams); their format is
# that of the name under the suffix, as in corpus.jsonl.gz. The value names a package the suffix needs.
COMPRESSION_SUFFIXES = {".gz": None, ".bz2": None, ".xz": None, ".zst": "zstandard"}


def builder_of_file(path: str, flag: str) -> str:
    """The `datasets` builder that reads the data file at `path` (given to --`flag`), from its extension."""
    stem, extension = os.path.splitext(path.lower())
    if extension in COMPRESSION_SUFFIXES:
        package = COMPRESSION_SUFFIXES[extension]
        if package and importlib.util.find_spec(package) is None:
            raise UsageError(f"--{flag}: reading {path} needs the {package} package: pip install {package}")
        stem, extension = os.path.splitext(stem)
        if extension == ".parquet":
            raise UsageError(
                f"--{flag}: {path} is a compressed Parquet file; Parquet compresses inside: decompress it"
            )
    if extension not in DATA_FILE_BUILDERS:
        supported = ", ".join(DATA_FILE_BUILDERS)
        compressed = ", ".join(COMPRESSION_SUFFIXES)
        raise UsageError(
            f"--{flag}: {path} has an unsupported extension; use one of {supported}, or one of these followed by "
            f"{compressed}"
        )
    return DATA_FILE_BUILDERS[extension]


def data_file_patterns(value) -> list[str]:
    """The files and globs of --train_file or --validation_file as a list: none, one (a string, as a JSON file of
    arguments may give it) or several."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def pattern_files(pattern: str) -> list[str]:
    """The files a path or glob names, a glob's in sorted order ('**' reaching into subdirectories, as in a shell
    with globstar; folders it matches left out)."""
    if not glob.has_magic(pattern):
        return [pattern]
    return sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))


def resolve_data_files(patterns, flag: str) -> dict[str, list[str]]:
    """The files that --`flag` names, in the order given and each once, grouped by the `datasets` builder of their
    format (pattern_files). Every tool that reads --train_file resolves it here, by one rule."""
    files = []
    for pattern in data_file_patterns(patterns):
        if glob.has_magic(pattern):
            matches = pattern_files(pattern)
            if not matches:
                raise UsageError(f"--{flag} {pattern} matches no file; check the path, and quote the pattern")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise UsageError(
                f"--{flag} {pattern} is a directory; pass the files in it ('{pattern}/*.txt', '{pattern}/**/*.jsonl') "
                "or the directory as --dataset_name"
            )
        else:
            files.append(pattern)
    groups = {}
    for path in dict.fromkeys(files):
        if not os.path.isfile(path):
            raise UsageError(f"--{flag}: {path} does not exist or is not a file")
        if not os.access(path, os.R_OK):
            raise UsageError(f"--{flag}: {path} is not readable")
        if os.path.getsize(path) == 0:
            raise UsageError(f"--{flag}: {path} is empty; leave it out")
        groups.setdefault(builder_of_file(path, flag), []).append(path)
    return groups


def files_checksum(paths: list[str]) -> str:
    """The XXH3-128 checksum of the bytes of `paths`, in their order: what identifies the content of local data
    files, whatever their names and modification times."""
    return xxhash.xxh3_128_hexdigest(" ".join(file_checksum(path) for path in paths).encode())


def folder_files(folder: str) -> list[str]:
    """The files under `folder`, in sorted order, leaving out hidden ones (and those of hidden folders), as `datasets`
    does when it reads a folder of data files."""
    return sorted(
        os.path.join(root, name)
        for root, folders, names in os.walk(folder)
        if not any(part.startswith(".") for part in os.path.relpath(root, folder).split(os.sep) if part != ".")
        for name in names
        if not name.startswith(".")
    )


def folder_holds_text_files(folder: str) -> bool:
    """Whether `folder` holds a file the text builder reads (.txt, .text, compressed or not)."""
    return any(
        DATA_FILE_BUILDERS.get(os.path.splitext(name.lower().removesuffix(suffix))[1]) == "text"
        for _, _, names in os.walk(folder)
        for name in names
        for suffix in ("", *COMPRESSION_SUFFIXES)
    )


def data_file_paths(patterns) -> set[str]:
    """The real paths of the files that data file patterns (files and globs) name."""
    return {os.path.realpath(path) for pattern in data_file_patterns(patterns) for path in pattern_files(pattern)}


def is_saved_dataset(directory: str) -> bool:
    """True for a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return any(os.path.isfile(os.path.join(directory, marker)) for marker in ("dataset_dict.json", "state.json"))

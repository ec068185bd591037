"""run_t5_mlm_flax.py as a command, on input/target pairs: its export loads in transformers, and its eval loss is
T5ForConditionalGeneration's loss on the same pairs, token-weighted over the whole set."""

import json
import string

import torch
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration, T5Tokenizer

WORDS = "the a cat dog sat ran on under mat log red blue big small one two three".split()


def t5_tokenizer(sentinels: int) -> T5Tokenizer:
    """A T5 tokenizer of single characters (and word starts), its sentinels numbered down from the top id."""
    characters = string.ascii_letters + string.digits + ".,;:!?'\"-()"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(character, -3.0) for character in characters]
    pieces += [("\u2581" + character, -3.5) for character in string.ascii_lowercase]
    pieces += [(f"<extra_id_{number}>", 0.0) for number in reversed(range(sentinels))]
    return T5Tokenizer(vocab=pieces, extra_ids=sentinels)


def write_pairs(path, count: int, seed: int):
    """JaxSeq's in_text/out_text rows of a few words each, of varying lengths."""
    generator = torch.Generator().manual_seed(seed)
    with open(path, "w") as file:
        for _ in range(count):
            words = [WORDS[index] for index in torch.randint(len(WORDS), (6,), generator=generator).tolist()]
            cut = 1 + int(torch.randint(4, (1,), generator=generator))
            file.write(json.dumps({"in_text": "copy: " + " ".join(words[:cut]), "out_text": " ".join(words[cut:])}))
            file.write("\n")


def test_pairs_train_and_the_eval_loss_is_pytorchs_on_the_export(run_tool, tmp_path):
    model_dir, output_dir = tmp_path / "t5", tmp_path / "out"
    t5_tokenizer(100).save_pretrained(model_dir)
    config = T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    config.save_pretrained(model_dir)
    write_pairs(tmp_path / "train.jsonl", 64, seed=0)
    write_pairs(tmp_path / "validation.jsonl", 10, seed=1)
    result = run_tool(
        "run_t5_mlm_flax.py",
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", tmp_path / "train.jsonl", "--validation_file", tmp_path / "validation.jsonl",
        "--cache_dir", tmp_path / "cache", "--max_seq_length", 48, "--max_steps", 4, "--logging_steps", 4,
        "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 4, "--do_train", "--do_eval",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((output_dir / "eval_results.json").read_text())

    model = T5ForConditionalGeneration.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    rows = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    inputs = tokenizer([row["in_text"] for row in rows], padding=True, return_tensors="pt")
    labels = tokenizer(text_target=[row["out_text"] for row in rows], padding=True, return_tensors="pt").input_ids
    labels[labels == tokenizer.pad_token_id] = -100
    with torch.no_grad():
        output = model(**inputs, labels=labels)  # the mean over every target token of the set
    counted = labels != -100
    correct = (output.logits.argmax(-1) == labels) & counted
    assert results["eval_target_tokens"] == int(counted.sum())
    assert abs(results["eval_loss"] - output.loss.item()) < 1e-4, (results["eval_loss"], output.loss.item())
    assert abs(results["eval_accuracy"] - correct.sum().item() / counted.sum().item()) < 1e-6
    # Four steps at Adafactor's 1e-2 moved the weights: the loss is below that of uniform guessing.
    assert results["eval_loss"] < torch.log(torch.tensor(256.0)).item()

"""What several model families compute alike, once: common.py (attention, rotary positions, RMSNorm, the gated MLP,
the decoder stack around the layers, the mapping onto the Hugging Face checkpoint layout), moe.py (the
mixture-of-experts layer: routing, dropless experts, the auxiliary losses) and moe_decoder.py (the decoder of the
mixture-of-experts families). A family's model.py imports from here, and its code fingerprint covers the files of this
folder it builds on (flax_lm/models/model_code.py)."""

"""What several model families compute alike, once: common.py (attention, rotary positions, RMSNorm, the gated MLP,
the decoder stack around the layers, the mapping onto the Hugging Face checkpoint layout). A family's model.py imports
from here, and its code fingerprint covers the files of this folder it imports from (flax_lm/models/model_code.py)."""

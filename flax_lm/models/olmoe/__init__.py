"""The olmoe family: its model module (model.py)."""

"""The mixtral family: its model module (model.py)."""

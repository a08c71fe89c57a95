"""The model family; sizes are presets in conf/model."""

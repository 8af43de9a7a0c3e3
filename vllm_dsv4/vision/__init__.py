"""Image input: preprocessing, token layout, vision tower and the multimodal model class."""

"""The config: the DeepSpeed JSON schema (pydantic sections, a leaf that imports none of the
components), reading a config file, the error every bad config raises, and the one resolve pass
(`resolve.resolve_config`) that turns a raw config into the frozen, resolved config."""

"""circuits_llm: circuit multi-token-prediction heads and lossless speculative decoding."""

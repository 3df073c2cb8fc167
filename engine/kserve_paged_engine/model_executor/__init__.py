"""The model side: layers, the attention layer, the model families, the loader, and the facts a
model gives the rest of the engine (model_facts.py); tensor-parallel layers and layout."""

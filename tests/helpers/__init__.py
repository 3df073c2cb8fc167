"""What test files share: engine-core requests and steps (`core`), tiny models of every family
(`tiny_models`), fake and real servers (`server`, `e2e_server`), LoRA adapters (`lora`),
speculative-decoding runs (`spec`), the metrics contract (`metrics_contract`), manifests
(`manifests`) and Triton's interpreter (`triton`, the `triton_interpreter` fixture of
tests/conftest.py). Test files import from here, never from one another."""

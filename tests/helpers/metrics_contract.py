"""The metric names dashboards, KEDA and the Gateway API Inference Extension read (the contract
of kserve_paged/metrics.py, docs/kserve.md), shared by the unit and e2e metric tests."""

# docs/kserve.md, "Metrics": the names dashboards and the Gateway API Inference Extension read.
CONTRACT_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total", "vllm:cache_config_info",
    # issue 24: parity with what the gateway and vLLM dashboards read, and the KV waste gauges
    "vllm:request_success_total", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:lora_requests_info",
    "kserve_paged:kv_slots_reserved", "kserve_paged:kv_slots_holding_tokens",
    "kserve_paged:kv_blocks_shared",
    # issue 21: speculative decoding
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}


# Ours, beside the contract (no vLLM equivalent): block sharing.
OWN_NAMES = {"kserve_paged:kv_blocks_shared", "kserve_paged:kv_cow_copies_total",
             # issue 37: the queue bound and deadlines (vLLM's style, not vLLM's)
             "vllm:num_requests_rejected_total", "vllm:num_requests_timed_out_total",
             # issue 36: the second KV tier (vLLM's offloading connector's tiering names)
             "vllm:kv_offload_tiering_block_queries_total",
             "vllm:kv_offload_tiering_block_hits_total",
             "vllm:kv_offload_tiering_read_bytes_total",
             "vllm:kv_offload_tiering_write_bytes_total",
             "vllm:kv_offload_tiering_read_time_total",
             "vllm:kv_offload_tiering_write_time_total",
             "kserve_paged:kv_offload_tier_usage_perc",
             "kserve_paged:kv_offload_tier_corrupt_blocks_total",
             # issue 36: preemption by swap to the tier (vLLM V0's gauge, counters in its style)
             "vllm:num_requests_swapped", "vllm:num_swap_outs_total", "vllm:num_swap_ins_total"}


HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"}

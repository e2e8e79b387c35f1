"""What a replica tells the processes around it (vLLM's ``vllm/distributed``): its KV events on the wire."""

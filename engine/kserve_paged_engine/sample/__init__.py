"""Logits to tokens: the sampler, penalties and logit bias, logprobs, structured-output masks.
It works on rows and their options, never on requests or queues."""

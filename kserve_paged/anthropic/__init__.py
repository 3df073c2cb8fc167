"""Anthropic's Messages API (`/v1/messages`), served through the chat completions path: the
request converted (`convert.py`), the streamed turn rendered as Anthropic's events
(`stream.py`), the routes and count_tokens (`messages.py`)."""

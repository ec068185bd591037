"""generate_flax.py --serve: the HTTP server with OpenAI's completions and chat APIs (app.py), the requests it
reads and checks (requests.py), and the queue that decodes requests together in shared batches (request_queue.py)."""

"""generate_flax.py's model that answers prompts, loaded onto the devices (generator.py), and its --serve: the HTTP
server with OpenAI's completions and chat APIs (app.py), the requests it reads and checks (requests.py), and the queue
that decodes requests together in shared batches (request_queue.py)."""

# Server: moeserve launch
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
curl -sf "$URL/tokenize" -H 'Content-Type: application/json' -d '{"prompt": "Hello world"}'
# A conversation, rendered through the chat template as /v1/chat/completions renders it:
curl -sf "$URL/tokenize" -H 'Content-Type: application/json' \
     -d '{"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": true}'
curl -sf "$URL/detokenize" -H 'Content-Type: application/json' -d '{"tokens": [72, 101, 108, 108, 111]}'

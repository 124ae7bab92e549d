// Package fakeengine is a fake LLM inference engine that behaves, over
// HTTP, like SGLang or vLLM as RL stacks drive them (docs in
// /work/shared/rl-engines.md): generation with a paged KV cache and a
// prefix cache, a step-loop scheduler, load endpoints, pause / abort /
// weight update / resume with each engine's semantics, and a weight
// version on every output token. It lets tether's tests check a router
// against engine behaviour (no output mixing weight versions, nothing
// parked in a paused engine, placement by KV usage and cache hits) with
// many engines on a small machine.
//
// # Model
//
// Tokens: input_ids / token_ids are used as they are; text (a prompt, or
// chat messages rendered "<|role|>content\n"... "<|assistant|>") becomes one
// token per 4 bytes ([Tokenize]), so equal text prefixes give equal token
// prefixes. Output token i of a request is [OutputToken](prompt, seed, i)
// (seed: sampling_params.sampling_seed or seed, or the OpenAI seed; default
// 0), its text [TokenText]: outputs are deterministic, across preemptions
// too. Requests decode to max_new_tokens / max_tokens (default 16); the
// only finish reasons are length and abort. n must be 1.
//
// Scheduler: one goroutine runs steps. Waiting requests (FIFO) join the
// running batch while it has fewer than MaxRunning and the KV blocks for
// their tokens are free (evicting unreferenced prefix-cache blocks, LRU,
// a context's tail before its root, as vLLM and SGLang evict);
// a step lasts DecodeStep plus PrefillPerToken per uncached token admitted
// (requests that arrive during a step join it at once, their prefill
// lengthening it) and decodes one token for each running request, which takes a new block
// every BlockTokens tokens. When no block is left, the newest running
// request is preempted: back to the head of the waiting queue, its blocks
// freed, recomputed later (Stats.Preemptions). A request whose prompt and
// max new tokens cannot fit the whole cache is a 400.
//
// Prefix cache: full blocks are keyed by a hash chain (the block's tokens
// and every token before). A prompt's full blocks enter the cache as soon
// as it is admitted (a request admitted later shares them); output blocks
// when it ends. A request's cached tokens are its longest chain of full
// blocks present (at least one token is always computed). KV usage counts
// the blocks held by requests, not the evictable cache, as both engines
// report it. Flushing (flush_cache, reset_prefix_cache, pause with
// clear_cache, sleep) and a weight update drop the cache: blocks that
// requests still hold are freed when they let go.
//
// Weight versions: every output token records the version in effect when
// it was decoded. SGLang answers carry meta_info.weight_version, OpenAI
// shapes a top-level weight_version (SGLang also metadata.weight_version),
// the version of the last token. A fake-only extension in every answer and
// stream event, weight_versions, lists the distinct versions of the output
// in order; Stats.MixedVersionOutputs counts outputs with more than one.
// An update that names no version (weight_version at the top of the body
// or in update_info) moves "v<N>" to "v<N+1>" (SGLang too, unlike the real
// one, which keeps its version: a test must see that weights changed).
//
// # SGLang (Kind SGLang)
//
//	POST /generate                 text | input_ids, sampling_params{max_new_tokens, sampling_seed}, rid, stream
//	POST /v1/completions           OpenAI (prompt string or ids), stream: SSE
//	POST /v1/chat/completions      OpenAI chat, stream: SSE
//	GET  /health, /health_generate 200
//	GET  /v1/loads                 {timestamp, version, loads:[{dp_rank:0, num_running_reqs, num_waiting_reqs,
//	                               num_used_tokens, num_total_tokens, max_total_num_tokens, token_usage,
//	                               cache_hit_rate, utilization, max_running_requests, queues}]}
//	GET  /get_load                 [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]
//	GET  /metrics                  sglang:num_running_reqs, num_queue_reqs, token_usage, cache_hit_rate, ... {model_name="Name"}
//	POST /pause_generation         {"mode": "abort"|"in_place"|"retract"} (default abort)
//	POST /continue_generation
//	POST /abort_request            {"rid"} | {"abort_all": true}: running and waiting, never the pause gate
//	POST /flush_cache              400 while a request runs or waits
//	POST /update_weights_from_disk, /update_weights_from_distributed, /update_weights_from_tensor
//	                               any JSON object, weight_version optional; 500 under SetFailUpdates
//	POST /init_weights_update_group, /destroy_weights_update_group   any JSON object, 200
//	GET  /get_weight_version; POST /update_weight_version {"new_version", "abort_all_requests"}
//	GET  /get_server_info, /get_model_info, /v1/models
//	POST /release_memory_occupation, /resume_memory_occupation   sleep / wake (nothing scheduled meanwhile)
//
// While paused, new requests wait at the pause gate, before the scheduler
// (Stats.Gated now, Stats.ParkedWhilePaused in all); abort aborts the
// running and waiting requests (partial outputs, finish_reason
// {"type":"abort"}); in_place freezes the running batch with its KV (an
// update then applies at once and the batch continues on the new weights:
// outputs spanning two versions, by design); retract moves the running
// requests back to waiting and frees their KV. Nothing is scheduled until
// continue_generation. An update while not paused takes the writer lock:
// new requests wait at the same gate (Stats.HeldForUpdate), in-flight ones
// finish, then the update runs for UpdateDelay.
//
// # vLLM (Kind VLLM)
//
//	POST /v1/completions           prompt string or ids, max_tokens, request_id (or X-Request-Id), stream
//	POST /v1/chat/completions
//	POST /inference/v1/generate    {token_ids, sampling_params{max_tokens, seed}} -> {request_id, choices:[{token_ids, finish_reason}]}
//	GET  /health, /v1/models, /get_world_size, /get_weight_version
//	GET  /metrics                  vllm:num_requests_running, num_requests_waiting, kv_cache_usage_perc,
//	                               prefix_cache_queries_total, prefix_cache_hits_total, ... {model_name="Name"}
//	POST /pause?mode=abort|wait|keep&clear_cache=true   (default abort; wait_for_inflight_requests=true is wait)
//	POST /resume; GET /is_paused
//	POST /abort_requests           {"request_ids": [...]}, {} = all: parked requests included
//	POST /reset_prefix_cache
//	POST /sleep, /wake_up; GET /is_sleeping
//	POST /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update
//
// While paused, new requests are accepted and parked in the waiting queue
// until /resume (Stats.ParkedWhilePaused); abort aborts running and waiting
// requests (finish_reason "abort"); wait answers once the requests that
// came before the pause finish (parked ones never run: a drain that waits
// for everything never ends); keep freezes them. abort and wait clear the
// prefix cache unless clear_cache=false. A weight update never waits for
// requests: between start_weight_update and finish_weight_update the
// version is staged and takes effect at finish (at /update_weights when no
// start came); the scheduler does not step while an /update_weights runs
// (UpdateDelay), so an unpaused update makes in-flight outputs span two
// versions. There is no /v1/loads (404).
//
// # Both
//
// Bad input is a 400 JSON error ({"error":{"message","type","code"}}), an
// unknown path a 404, a wrong method a 405 with Allow. With APIKey set,
// "Authorization: Bearer KEY" is required (vLLM: on /v1/* only; SGLang:
// everywhere but /health and /metrics), else 401. A client that goes away
// aborts its request. SetLoadMode makes the load endpoints (/v1/loads,
// /get_load, /metrics) hang, lie or vanish; SetFailUpdates makes updates
// answer 500; Kill drops the listener and every connection at once;
// LastBody returns the bytes of the last body sent to a path.
package fakeengine

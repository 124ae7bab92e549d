package fakepd

import (
	"context"
	"net/http"
	"strings"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

// answer decodes g's tokens from 0 and writes them in the shape of g's
// path, streamed or whole; extra fields go at the top of the answer (a
// prefill's kv_transfer_params). It returns false when ctx ended first.
func answer(ctx context.Context, w http.ResponseWriter, g *genRequest, n int, delayFn func() bool, extra map[string]any) bool {
	chat := strings.HasSuffix(g.path, "/chat/completions")
	generate := g.path == "/generate"
	if g.stream {
		startSSE(w)
	}
	var text strings.Builder
	ids := make([]int, 0, n)
	for i := 0; i < n; i++ {
		if !delayFn() || ctx.Err() != nil {
			return false
		}
		t := g.token(i)
		ids = append(ids, t)
		text.WriteString(fakeengine.TokenText(t))
		if !g.stream {
			continue
		}
		var ev map[string]any
		switch {
		case generate:
			ev = generateAnswer(g, text.String(), ids, i == n-1)
		case chat:
			ev = map[string]any{"id": "chatcmpl-" + g.rid, "object": "chat.completion.chunk",
				"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": fakeengine.TokenText(t)}, "finish_reason": finish(i == n-1)}}}
		default:
			ev = map[string]any{"id": "cmpl-" + g.rid, "object": "text_completion",
				"choices": []any{map[string]any{"index": 0, "text": fakeengine.TokenText(t), "finish_reason": finish(i == n-1)}}}
		}
		if writeEvent(w, ev) != nil {
			return false
		}
	}
	if g.stream {
		if n == 0 && generate {
			writeEvent(w, generateAnswer(g, "", ids, true))
		}
		w.Write([]byte("data: [DONE]\n\n"))
		return true
	}
	var out map[string]any
	usage := map[string]any{"prompt_tokens": len(g.prompt), "completion_tokens": n, "total_tokens": len(g.prompt) + n}
	switch {
	case generate:
		out = generateAnswer(g, text.String(), ids, true)
	case chat:
		out = map[string]any{"id": "chatcmpl-" + g.rid, "object": "chat.completion", "usage": usage,
			"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text.String()}, "finish_reason": "length"}}}
	default:
		out = map[string]any{"id": "cmpl-" + g.rid, "object": "text_completion", "usage": usage,
			"choices": []any{map[string]any{"index": 0, "text": text.String(), "finish_reason": "length"}}}
	}
	for k, v := range extra {
		out[k] = v
	}
	writeJSON(w, http.StatusOK, out)
	return true
}

func finish(last bool) any {
	if last {
		return "length"
	}
	return nil
}

// generateAnswer is SGLang's /generate answer (or stream event).
func generateAnswer(g *genRequest, text string, ids []int, done bool) map[string]any {
	mi := map[string]any{"id": g.rid, "prompt_tokens": len(g.prompt), "completion_tokens": len(ids)}
	if done {
		mi["finish_reason"] = map[string]any{"type": "length", "length": len(ids)}
	} else {
		mi["finish_reason"] = nil
	}
	if g.logprob {
		mi["input_token_logprobs"] = []any{} // the decode computes no prompt rows
		out := make([]any, len(ids))
		for i, t := range ids {
			out[i] = []any{-0.5, t, nil}
		}
		mi["output_token_logprobs"] = out
	}
	return map[string]any{"text": text, "output_ids": ids, "meta_info": mi}
}

// promptLogprobs are a prefill's rows for the prompt.
func promptLogprobs(prompt []int) []any {
	out := make([]any, len(prompt))
	for i, t := range prompt {
		var lp any
		if i > 0 {
			lp = -float64(t%97) / 10
		}
		out[i] = []any{lp, t, nil}
	}
	return out
}

package fakepd

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

// answer decodes g's tokens 0..n-1 and writes them in the shape of g's
// path, streamed or whole; o is the decode's (its steps: slot, pause,
// token time, versions, abort), nil for an answer at once without
// versions; cached is the prompt tokens the prefill had cached; extra
// fields go at the top of the answer (a prefill's kv_transfer_params). An
// aborted decode ends with its partial output and finish reason abort
// (o.aborted). It returns true when the answer was written whole, false
// when it was aborted or ctx ended first (then nothing more is written).
func answer(ctx context.Context, w http.ResponseWriter, g *genRequest, n int, o *out, cached int, extra map[string]any) bool {
	chat := strings.HasSuffix(g.path, "/chat/completions")
	generate := g.path == "/generate"
	if g.stream {
		startSSE(w)
	}
	var text strings.Builder
	ids := make([]int, 0, n)
	reason := "length"
	for i := 0; i < n; i++ {
		if o != nil {
			if err := o.step(); errors.Is(err, errAborted) {
				reason = "abort"
				break
			} else if err != nil {
				return false
			}
		} else if ctx.Err() != nil {
			return false
		}
		t := g.token(i)
		ids = append(ids, t)
		text.WriteString(fakeengine.TokenText(t))
		if !g.stream || i == n-1 {
			continue // the last token goes with the finish
		}
		piece := fakeengine.TokenText(t)
		if generate {
			piece = text.String() // SGLang's events carry the text so far
		}
		if writeEvent(w, event(g, piece, ids, "", nil, cached)) != nil {
			return false
		}
	}
	var versions []string
	if o != nil {
		versions = o.versions
		o.s.Stats.OutputTokens.Add(int64(len(ids)))
		o.done()
	}
	if g.stream {
		last := ""
		switch {
		case generate:
			last = text.String()
		case len(ids) > 0 && reason == "length":
			last = fakeengine.TokenText(ids[len(ids)-1])
		}
		if n > 0 || generate {
			writeEvent(w, event(g, last, ids, reason, versions, cached))
		}
		w.Write([]byte("data: [DONE]\n\n"))
		return reason != "abort"
	}
	var ans map[string]any
	usage := map[string]any{"prompt_tokens": len(g.prompt), "completion_tokens": len(ids), "total_tokens": len(g.prompt) + len(ids),
		"prompt_tokens_details": map[string]any{"cached_tokens": cached}}
	switch {
	case generate:
		ans = generateAnswer(g, text.String(), ids, reason, versions, cached)
	case chat:
		ans = map[string]any{"id": "chatcmpl-" + g.rid, "object": "chat.completion", "usage": usage,
			"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text.String()}, "finish_reason": reason}}}
	default:
		ans = map[string]any{"id": "cmpl-" + g.rid, "object": "text_completion", "usage": usage,
			"choices": []any{map[string]any{"index": 0, "text": text.String(), "finish_reason": reason}}}
	}
	if versions != nil && !generate {
		ans["weight_versions"] = versions
	}
	for k, v := range extra {
		ans[k] = v
	}
	writeJSON(w, http.StatusOK, ans)
	return reason != "abort"
}

// event is one SSE event of g's path: a token's text (ids so far for
// /generate); finish "" while more follow.
func event(g *genRequest, text string, ids []int, finish string, versions []string, cached int) map[string]any {
	var fin any
	if finish != "" {
		fin = finish
	}
	var ev map[string]any
	switch {
	case g.path == "/generate":
		return generateAnswer(g, text, ids, finish, versions, cached)
	case strings.HasSuffix(g.path, "/chat/completions"):
		ev = map[string]any{"id": "chatcmpl-" + g.rid, "object": "chat.completion.chunk",
			"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": text}, "finish_reason": fin}}}
	default:
		ev = map[string]any{"id": "cmpl-" + g.rid, "object": "text_completion",
			"choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": fin}}}
	}
	if versions != nil {
		ev["weight_versions"] = versions
	}
	return ev
}

// generateAnswer is SGLang's /generate answer (or stream event: the text
// so far); finish "" while more follow.
func generateAnswer(g *genRequest, text string, ids []int, finish string, versions []string, cached int) map[string]any {
	mi := map[string]any{"id": g.rid, "prompt_tokens": len(g.prompt), "completion_tokens": len(ids), "cached_tokens": cached}
	switch finish {
	case "":
		mi["finish_reason"] = nil
	case "abort":
		mi["finish_reason"] = map[string]any{"type": "abort", "message": "Abort before or while decoding"}
	default:
		mi["finish_reason"] = map[string]any{"type": finish, "length": len(ids)}
	}
	if versions != nil {
		mi["weight_versions"] = versions
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

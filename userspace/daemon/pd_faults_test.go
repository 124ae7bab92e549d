package daemon

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakepd"
)

// faulty is what the fault matrix asks of a fake engine besides pdEngine.
type faulty interface {
	pdEngine
	FailNext(status, n int)
	SlowNext(d time.Duration, n int)
}

// byDeadline fails t unless cond holds by deadline (polled until then).
func byDeadline(t *testing.T, what string, deadline time.Time, cond func() bool) {
	t.Helper()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not by its deadline", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestPDFaultMatrix: the faults through tetherd, each engine and
// each fault, on 2 prefills and 1 decode (SGLang without abort
// notification between the sides, as older engines; vLLM with it, which
// its NIXL connector needs to free blocks before their lease ends):
//
//	prefill killed mid-request: the client has its answer (a new pair)
//	    within 2 s, the decode leg (SGLang: waiting for its room) ended
//	    within 1 s of the kill;
//	decode killed mid-stream: the stream ends visibly (a JSON error
//	    event) within 2 s, the prefill holds no room or blocks within 1 s;
//	prefill answering 400: the client has the 400 within 2 s, the decode
//	    leg cancelled within 1 s of it;
//	decode answering 500: the client has its answer (the retry) within
//	    2 s, the first attempt's room or blocks let go within 1 s of it;
//
// and afterwards no engine holds anything, nor tetherd anything in flight.
func TestPDFaultMatrix(t *testing.T) {
	for _, proto := range []PDProtocol{PDSGLang, PDVLLM} {
		for _, fault := range []string{"prefill-killed", "decode-killed-mid-stream", "prefill-400", "decode-500"} {
			t.Run(string(proto)+"/"+fault, func(t *testing.T) { pdFault(t, proto, fault) })
		}
	}
}

func pdFault(t *testing.T, proto PDProtocol, fault string) {
	o := fakepd.Options{WaitTimeout: time.Minute, Lease: time.Minute, Notify: proto == PDVLLM}
	d := o
	d.TokenDelay = 10 * time.Millisecond
	f := startPDFleet(t, proto, []fakepd.Options{o, o}, []fakepd.Options{d})
	base := "http://" + f.d.Addr()
	c := newClient(t)
	path := pdPaths(proto)[0]
	prefills := []faulty{f.prefills[0].(faulty), f.prefills[1].(faulty)}
	dec := f.decodes[0].(faulty)
	sumP := func(get func(*fakepd.Stats) int64) int64 {
		return get(pdStats(prefills[0])) + get(pdStats(prefills[1]))
	}
	type answer struct {
		status int
		body   []byte
		err    error
		at     time.Time
	}
	send := func(prompt string, n int) <-chan answer {
		ch := make(chan answer, 1)
		go func() {
			resp, b, err := pdPost(c, base, path, pdBody(path, prompt, n, false), nil)
			a := answer{body: b, err: err, at: time.Now()}
			if resp != nil {
				a.status = resp.StatusCode
			}
			ch <- a
		}()
		return ch
	}
	wait := func(ch <-chan answer, by time.Time) answer {
		t.Helper()
		select {
		case a := <-ch:
			if a.at.After(by) {
				t.Errorf("answered %v after its deadline", a.at.Sub(by))
			}
			return a
		case <-time.After(time.Until(by) + 30*time.Second):
			t.Fatal("no answer")
		}
		return answer{}
	}

	switch fault {
	case "prefill-killed":
		for _, p := range prefills {
			p.SlowNext(time.Hour, 1)
		}
		ch := send("killed in its prefill", 4)
		var victim, other faulty
		testenv.WaitFor(t, "a prefill computing the request", func() bool {
			for i, p := range prefills {
				if pdStats(p).Requests.Load() == 1 {
					victim, other = p, prefills[1-i]
					return proto == PDVLLM || dec.Held() == 1
				}
			}
			return false
		})
		other.SlowNext(0, 0)
		killed := time.Now()
		victim.Kill()
		if proto == PDSGLang {
			byDeadline(t, "the decode leg waiting for the room ended", killed.Add(time.Second), func() bool {
				return pdStats(dec).Aborted.Load() == 1
			})
		}
		a := wait(ch, killed.Add(2*time.Second))
		if got, err := pdText(path, a.body); a.status != 200 || err != nil || got != pdWant(path, "killed in its prefill", 4) {
			t.Fatalf("answer %d %v %s", a.status, a.err, a.body)
		}
	case "decode-killed-mid-stream":
		req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(pdBody(path, "cut short", 500, true)))
		resp, err := c.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%v %v", err, resp)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
			t.Fatalf("first event: %q %v", line, err)
		}
		killed := time.Now()
		dec.Kill()
		rest, _ := io.ReadAll(br)
		if took := time.Since(killed); took > 2*time.Second {
			t.Errorf("the stream ended %v after the kill, want within 2 s", took)
		}
		var last string
		for _, l := range strings.Split(string(rest), "\n") {
			if strings.HasPrefix(l, "data: ") {
				last = strings.TrimPrefix(l, "data: ")
			}
		}
		var ev struct {
			Error *struct{ Message string } `json:"error"`
		}
		if json.Unmarshal([]byte(last), &ev) != nil || ev.Error == nil {
			t.Errorf("the stream's last event %q is no JSON error event", last)
		}
		byDeadline(t, "the prefills to hold no room or blocks", killed.Add(time.Second), func() bool {
			return prefills[0].Held()+prefills[1].Held() == 0
		})
	case "prefill-400":
		for _, p := range prefills {
			p.FailNext(http.StatusBadRequest, 1)
		}
		a := wait(send("refused", 4), time.Now().Add(2*time.Second))
		if a.status != http.StatusBadRequest || !strings.Contains(string(a.body), "injected fault") {
			t.Fatalf("answer %d %v %s", a.status, a.err, a.body)
		}
		byDeadline(t, "the decode leg cancelled", a.at.Add(time.Second), func() bool {
			return dec.Held() == 0 && pdStats(dec).Served.Load() == 0
		})
		for _, p := range prefills {
			p.FailNext(0, 0)
		}
	case "decode-500":
		dec.FailNext(http.StatusInternalServerError, 1)
		a := wait(send("decode fails once", 4), time.Now().Add(2*time.Second))
		if got, err := pdText(path, a.body); a.status != 200 || err != nil || got != pdWant(path, "decode fails once", 4) {
			t.Fatalf("answer %d %v %s", a.status, a.err, a.body)
		}
		byDeadline(t, "the first attempt's room or blocks let go", a.at.Add(time.Second), func() bool {
			if proto == PDSGLang {
				return sumP(func(s *fakepd.Stats) int64 { return s.Aborted.Load() }) == 1
			}
			return sumP(func(s *fakepd.Stats) int64 { return s.Notified.Load() }) == 1
		})
		if st := pdStats(dec); st.Failed.Load() != 1 || st.Served.Load() != 1 {
			t.Errorf("the decode failed %d, served %d", st.Failed.Load(), st.Served.Load())
		}
	}
	testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
	testenv.WaitFor(t, "nothing in flight in tetherd", func() bool { return f.inFlight() == 0 })
}

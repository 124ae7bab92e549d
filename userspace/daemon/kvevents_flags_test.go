package daemon

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/registry"
)

func TestParseWorkerKVEvents(t *testing.T) {
	for _, tc := range []struct {
		in, url, ep, rp string // url "": refused
	}{
		{"http://10.0.0.7:8001=tcp://10.0.0.7:5567,tcp://10.0.0.7:5568", "http://10.0.0.7:8001", "tcp://10.0.0.7:5567", "tcp://10.0.0.7:5568"},
		{"http://10.0.0.7:8001=tcp://10.0.0.7:5567", "http://10.0.0.7:8001", "tcp://10.0.0.7:5567", ""},
		{"HTTP://Engine-3.Example:8001/=tcp://engine-3.example:5567", "http://engine-3.example:8001", "tcp://engine-3.example:5567", ""},
		{"http://10.0.0.7=tcp://10.0.0.7:5557", "http://10.0.0.7", "tcp://10.0.0.7:5557", ""},
		{"http://[::1]:8001=tcp://[::1]:5557", "http://[::1]:8001", "tcp://[::1]:5557", ""},
		// '=' in the URL: a prefill's bootstrap port, taken off as --prefill's.
		{"http://10.0.0.7:8000?bootstrap_port=8998=tcp://10.0.0.7:5557,tcp://10.0.0.7:5558", "http://10.0.0.7:8000", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"},
		{"http://h:1=tcp://{host}:5557", "http://h:1", "tcp://{host}:5557", ""},
		{"http://h:1", "", "", ""},
		{"tcp://h:1", "", "", ""},
		{"http://h:1=udp://h:2", "", "", ""},
		{"http://h:1=http://h:2", "", "", ""},
		{"=tcp://h:1", "", "", ""},
		{"http://h:1=tcp://h", "", "", ""},
		{"http://h:1=tcp://h:", "", "", ""},
		{"http://h:1=tcp://h:0", "", "", ""},
		{"http://h:1=tcp://h:65536", "", "", ""},
		{"http://h:1=tcp://h:x", "", "", ""},
		{"http://h:1=tcp://:5557", "", "", ""},
		{"http://h:1=tcp://*:5557", "", "", ""}, // the engine's bind form
		{"http://h:1=tcp://h:2/x", "", "", ""},
		{"http://h:1=tcp://h:2,", "", "", ""},
		{"http://h:1=tcp://h:2,udp://h:3", "", "", ""},
		{"http://h:1=tcp://h:2,tcp://h:3,tcp://h:4", "", "", ""},
		{"http://h:1=tcp://h:2 tcp://h:3", "", "", ""},
		{"https://h:1=tcp://h:2", "", "", ""},
		{"http://h:1/v1=tcp://h:2", "", "", ""},
		{"http://h:1?x=1=tcp://h:2", "", "", ""},
		{"http://h:1?bootstrap_port=0=tcp://h:2", "", "", ""},
		{"http://h:99999=tcp://h:2", "", "", ""},
	} {
		u, ep, err := parseWorkerKVEvents(tc.in)
		if tc.url == "" {
			if err == nil {
				t.Errorf("%q accepted: %s %v", tc.in, u, ep)
			} else if !strings.Contains(err.Error(), "--worker-kv-events") {
				t.Errorf("%q: the error names no flag: %v", tc.in, err)
			}
			continue
		}
		if err != nil || u != tc.url || ep != [2]string{tc.ep, tc.rp} {
			t.Errorf("%q: %q %q %v, want %q %q %q", tc.in, u, ep, err, tc.url, tc.ep, tc.rp)
		}
	}
}

// New refuses a malformed --worker-kv-events, or one URL named twice
// (in two spellings), before it opens anything.
func TestWorkerKVEventsRefused(t *testing.T) {
	for _, ws := range [][]string{
		{"http://127.0.0.1:1"},
		{"http://127.0.0.1:1=tcp://127.0.0.1"},
		{"http://127.0.0.1:1=tcp://127.0.0.1:2", "HTTP://127.0.0.1:1/=tcp://127.0.0.1:3"},
	} {
		_, err := New(Options{Listen: "127.0.0.1:0", BPF: "off", Workers: []string{"http://127.0.0.1:1"},
			Routing: RoutingOptions{KVEvents: KVEventsOptions{Workers: ws}}})
		if err == nil || !strings.Contains(err.Error(), "--worker-kv-events") {
			t.Errorf("%q: %v", ws, err)
		}
	}
}

// A worker named by --worker-kv-events is subscribed at its own endpoint,
// not the template's; an admin endpoint goes over it and, dropped, gives
// it back the flag's (not the template's).
func TestWorkerKVEventsFlag(t *testing.T) {
	es, urls := fakeFleet(t, 2, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16,
		KVEvents: &fakeengine.KVEventsConfig{Form: kvevents.MapForm, Hashes: kvevents.HashInt, Replay: true}})
	port := func(ep string) string {
		_, p, _ := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://"))
		return p
	}
	// The template names engine 0's ports: right for it, wrong for engine 1.
	kv := KVEventsOptions{Template: "tcp://{host}:" + port(es[0].KVEventsEndpoint()),
		ReplayTemplate: "tcp://{host}:" + port(es[0].KVEventsReplayEndpoint()),
		Workers:        []string{strings.ToUpper(urls[1][:4]) + urls[1][4:] + "/=" + es[1].KVEventsEndpoint() + "," + es[1].KVEventsReplayEndpoint()}}
	d, _ := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{StickyStore: "memory", KVEvents: kv}})
	subscribed := func(u, ep, rp string) func() bool {
		return func() bool {
			st, _, _ := d.KVEventsStatus()
			s := st[u]
			return len(s) == 1 && s[0].Endpoint == ep && s[0].Replay == rp && s[0].Connected
		}
	}
	testenv.WaitFor(t, "engine 0 at the template's endpoint", subscribed(urls[0], es[0].KVEventsEndpoint(), es[0].KVEventsReplayEndpoint()))
	testenv.WaitFor(t, "engine 1 at its own endpoint", subscribed(urls[1], es[1].KVEventsEndpoint(), es[1].KVEventsReplayEndpoint()))
	// The publishers count a subscriber once its handshake is done, which
	// may be after the subscriber says it is connected.
	testenv.WaitFor(t, "one subscriber on each engine", func() bool {
		return es[0].KVEventsSubscribers() == 1 && es[1].KVEventsSubscribers() == 1
	})
	if err := d.SetWorkerKVEvents(urls[1], es[0].KVEventsEndpoint(), ""); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "the admin's endpoint over the flag's", subscribed(urls[1], es[0].KVEventsEndpoint(), ""))
	if err := d.SetWorkerKVEvents(urls[1]+"/", "", ""); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "the flag's endpoint back", subscribed(urls[1], es[1].KVEventsEndpoint(), es[1].KVEventsReplayEndpoint()))
}

// --worker-kv-events alone turns KV-event placement on.
func TestWorkerKVEventsFlagTurnsPlacementOn(t *testing.T) {
	es, urls := fakeFleet(t, 1, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16,
		KVEvents: &fakeengine.KVEventsConfig{Form: kvevents.ArrayForm, Hashes: kvevents.HashUint}})
	d, _ := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{StickyStore: "memory",
		KVEvents: KVEventsOptions{Workers: []string{urls[0] + "=" + es[0].KVEventsEndpoint()}}}})
	if _, _, on := d.KVEventsStatus(); !on {
		t.Fatal("KV-event placement off")
	}
	testenv.WaitFor(t, "subscribed", func() bool { return es[0].KVEventsSubscribers() == 1 })
}

// FuzzParseWorkerKVEvents: whatever it accepts is a canonical worker URL
// and endpoints the admin API would take, and written back in the flag's
// form it parses to the same.
func FuzzParseWorkerKVEvents(f *testing.F) {
	for _, s := range []string{
		"http://10.0.0.7:8001=tcp://10.0.0.7:5567,tcp://10.0.0.7:5568",
		"HTTP://Engine-3.Example:8001/=tcp://engine-3.example:5567",
		"http://10.0.0.7:8000?bootstrap_port=8998=tcp://10.0.0.7:5557",
		"http://[::1]:8001=tcp://[::1]:5557",
		"http://h:1=tcp://{host}:5557,tcp://{host}:5558",
		"http://h:1=tcp://*:5557",
		"=tcp://h:1,",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		u, ep, err := parseWorkerKVEvents(s)
		if err != nil {
			return
		}
		if canon, _, err := registry.ParseURL(u); err != nil || canon != u {
			t.Fatalf("%q: URL %q not canonical (%q, %v)", s, u, canon, err)
		}
		if err := checkKVEndpoint("kv_events", ep[0]); err != nil {
			t.Fatalf("%q: endpoint %q: %v", s, ep[0], err)
		}
		back := u + "=" + ep[0]
		if ep[1] != "" {
			if err := checkKVEndpoint("kv_events_replay", ep[1]); err != nil {
				t.Fatalf("%q: replay %q: %v", s, ep[1], err)
			}
			back += "," + ep[1]
		}
		u2, ep2, err := parseWorkerKVEvents(back)
		if err != nil || u2 != u || ep2 != ep {
			t.Fatalf("%q -> %q: %q %q %v, want %q %q", s, back, u2, ep2, err, u, ep)
		}
	})
}

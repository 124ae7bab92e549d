package kvevents

import (
	"encoding/binary"
	"net"
	"sync"
	"time"
)

// Publisher is an engine's side of KV events, for the fake engine and
// tests: a ZMTP PUB socket (bound, as engines bind "tcp://*:5557") that
// sends [topic, seq, payload] to every subscribed peer, and optionally a
// replay ROUTER that answers a DEALER's [empty, start seq] with every
// buffered batch from start on, then the end marker (seq -1, empty
// payload). Sends never block the caller: a peer whose queue is full
// loses messages, as at a PUB's high-water mark.
type Publisher struct {
	cfg     PublisherConfig
	ln, rln net.Listener

	mu     sync.Mutex
	seq    uint64
	buf    []replayed // the last cfg.Buffer batches
	peers  map[*pubPeer]bool
	closed bool
	wg     sync.WaitGroup
}

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	Addr       string // listen address; default 127.0.0.1:0
	Replay     bool   // serve a replay ROUTER
	ReplayAddr string // its listen address; default 127.0.0.1:0
	Buffer     int    // batches kept for replay; default 10,000
	Topic      string
	// TopicInReplies: vLLM >= 0.26 puts the topic first in replay
	// replies too; SGLang does not.
	TopicInReplies bool
	HWM            int // queued messages per peer; default 100,000
}

type pubPeer struct {
	z      *zconn
	q      chan [2][]byte // seq, payload
	subbed chan struct{}
	once   sync.Once
}

// NewPublisher binds the sockets and starts serving.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.ReplayAddr == "" {
		cfg.ReplayAddr = "127.0.0.1:0"
	}
	if cfg.Buffer <= 0 {
		cfg.Buffer = 10000
	}
	if cfg.HWM <= 0 {
		cfg.HWM = 100000
	}
	p := &Publisher{cfg: cfg, peers: map[*pubPeer]bool{}}
	var err error
	if p.ln, err = net.Listen("tcp", cfg.Addr); err != nil {
		return nil, err
	}
	if cfg.Replay {
		if p.rln, err = net.Listen("tcp", cfg.ReplayAddr); err != nil {
			p.ln.Close()
			return nil, err
		}
		p.wg.Add(1)
		go p.acceptReplay()
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Endpoint is the PUB socket's tcp:// address.
func (p *Publisher) Endpoint() string { return "tcp://" + p.ln.Addr().String() }

// ReplayEndpoint is the ROUTER's tcp:// address ("" without replay).
func (p *Publisher) ReplayEndpoint() string {
	if p.rln == nil {
		return ""
	}
	return "tcp://" + p.rln.Addr().String()
}

// Subscribers returns how many peers have subscribed.
func (p *Publisher) Subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for pp := range p.peers {
		select {
		case <-pp.subbed:
			n++
		default:
		}
	}
	return n
}

// Seq is the sequence number the next batch gets.
func (p *Publisher) Seq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// Publish encodes and sends a batch; it returns its sequence number.
func (p *Publisher) Publish(b *Batch, f Form, h HashForm) (uint64, error) {
	payload, err := Encode(b, f, h)
	if err != nil {
		return 0, err
	}
	return p.PublishPayload(payload, true), nil
}

// PublishPayload sends payload as the next batch (send false: buffered
// for replay but not sent, a loss the subscriber sees as a gap).
func (p *Publisher) PublishPayload(payload []byte, send bool) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.seq
	p.seq++
	p.buf = append(p.buf, replayed{seq, payload})
	if len(p.buf) > p.cfg.Buffer {
		p.buf = p.buf[len(p.buf)-p.cfg.Buffer:]
	}
	if send {
		p.sendLocked(seq, payload)
	}
	return seq
}

// SendRaw sends a message with any sequence number and payload (tests:
// malformed batches, out-of-order numbers), not buffered.
func (p *Publisher) SendRaw(seq uint64, payload []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sendLocked(seq, payload)
}

func (p *Publisher) sendLocked(seq uint64, payload []byte) {
	if p.closed {
		return
	}
	var s [8]byte
	binary.BigEndian.PutUint64(s[:], seq)
	for pp := range p.peers {
		select {
		case <-pp.subbed:
		default:
			continue // not subscribed yet: the slow joiner misses it
		}
		select {
		case pp.q <- [2][]byte{s[:], payload}:
		default: // high-water mark: dropped
		}
	}
}

// Restart acts out an engine restart: every connection closed, the
// sequence back to 0, the replay buffer empty.
func (p *Publisher) Restart() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pp := range p.peers {
		pp.close()
		delete(p.peers, pp)
	}
	p.seq, p.buf = 0, nil
}

// Close stops the publisher.
func (p *Publisher) Close() {
	p.mu.Lock()
	p.closed = true
	for pp := range p.peers {
		pp.close()
	}
	p.mu.Unlock()
	p.ln.Close()
	if p.rln != nil {
		p.rln.Close()
	}
	p.wg.Wait()
}

func (pp *pubPeer) close() { pp.once.Do(func() { pp.z.close(); close(pp.q) }) }

func (p *Publisher) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Publisher) serve(c net.Conn) {
	defer p.wg.Done()
	z, _, err := handshake(c, "PUB", true, 2*time.Second)
	if err != nil {
		c.Close()
		return
	}
	pp := &pubPeer{z: z, q: make(chan [2][]byte, min(p.cfg.HWM, 1<<16)), subbed: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		z.close()
		return
	}
	p.peers[pp] = true
	p.mu.Unlock()
	topic := []byte(p.cfg.Topic)
	go func() { // the writer
		for m := range pp.q {
			if err := z.send(topic, m[0], m[1]); err != nil {
				pp.z.close()
			}
		}
	}()
	var frames [][]byte
	for {
		frames, err = z.recv(frames)
		if err != nil {
			break
		}
		if len(frames) == 1 && len(frames[0]) > 0 && frames[0][0] == 1 {
			pp.once2()
		}
	}
	p.mu.Lock()
	delete(p.peers, pp)
	p.mu.Unlock()
	pp.close()
}

func (pp *pubPeer) once2() {
	select {
	case <-pp.subbed:
	default:
		close(pp.subbed)
	}
}

func (p *Publisher) acceptReplay() {
	defer p.wg.Done()
	for {
		c, err := p.rln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go p.serveReplay(c)
	}
}

func (p *Publisher) serveReplay(c net.Conn) {
	defer p.wg.Done()
	defer c.Close()
	z, _, err := handshake(c, "ROUTER", true, 2*time.Second)
	if err != nil {
		return
	}
	var frames [][]byte
	for {
		if frames, err = z.recv(frames); err != nil {
			return
		}
		for len(frames) > 0 && len(frames[0]) == 0 {
			frames = frames[1:]
		}
		if len(frames) != 1 || len(frames[0]) != 8 {
			return
		}
		start := binary.BigEndian.Uint64(frames[0])
		p.mu.Lock()
		var out []replayed
		for _, r := range p.buf {
			if r.seq >= start {
				out = append(out, r)
			}
		}
		p.mu.Unlock()
		out = append(out, replayed{endSeq, nil})
		for _, r := range out {
			var s [8]byte
			binary.BigEndian.PutUint64(s[:], r.seq)
			if p.cfg.TopicInReplies {
				err = z.send(nil, []byte(p.cfg.Topic), s[:], r.payload)
			} else {
				err = z.send(nil, s[:], r.payload)
			}
			if err != nil {
				return
			}
		}
	}
}

package kvindex

import (
	"bytes"
	"hash/maphash"
	"math/bits"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
)

// The lookup: token ids read from a request body (SGLang /generate
// "input_ids", a list or the first list of a batch; OpenAI/vLLM "prompt" as
// a list of ids), hashed a full block at a time as they are read, looked up
// 32 blocks at a time, and the reading stops at the first block no engine
// holds. No tokenizer, no allocation, never more than the peeked bytes:
// the decision needs the matched prefix only. A text prompt is no match
// (placement as without the index).

// Match is what Scan found: per engine, how many leading blocks of the
// request it holds (or was credited with by a decision moments ago).
type Match struct {
	Blocks    [MaxEngines]uint16
	Engines   uint64 // engines with Blocks > 0
	BlockSize int
	Tokens    int    // token ids read
	Prompt    int    // prompt tokens: exact when Complete, else estimated from the body's length
	Complete  bool   // the whole prompt was within the bytes read
	NBlocks   int    // full blocks hashed
	Last      uint64 // key of the last block hashed
	// Credited: a request with the same start was placed on
	// CreditEngine moments ago (Credit), Siblings times within CreditTTL.
	Credited     bool
	CreditEngine EngineID
	Siblings     int
	// Strict, set by the caller after Scan (a keyed request, whose key
	// keeps its session together): the request is no credit's sibling,
	// only the credited blocks known shared count (DropSibling), and
	// Credit neither follows a credit nor takes it over. Prompts sharing
	// a start (a system prompt, all that the bytes read before routing
	// may show) and a length are not one prompt, and a session placed
	// with another's by mistake stays there for all its turns.
	Strict    bool
	precredit uint16 // Blocks[CreditEngine] before the credit was applied
	body      int64  // the body's length (Scan's contentLength; <= 0: unknown)
	ckey      uint64 // the credit key Credit uses: the one a live credit was found under, else the first
	// Stopped: the scan came to a block no engine's events hold
	// (credits aside); false: every full block read is held by some
	// engine, and the prefix matched may go on past the bytes read.
	Stopped bool
	// ident is the prompt's identity, the key of its credits (credit.go):
	// its token-id list's length and last bytes, within the first
	// CreditWindow bytes of the list. identExact: the whole list is in
	// the window, so the identity names the prompt whatever else the
	// body holds; otherwise (identCut) the body's length completes it.
	// identShort: neither the list's end nor the window's was read (the
	// identity would depend on how much of the body arrived: PeekMore
	// reads on).
	ident      uint64
	identExact bool
	identShort bool
	// heldKey: the key of the deepest block some engine's events hold
	// (0: none), the prefix SharedPrefix asks about.
	heldKey uint64
}

// CreditWindow bounds the bytes of a token-id list that name a prompt for
// its credits: a list that ends within it names its prompt exactly; a
// longer one by the window and the body's length. A request whose first
// read holds neither end is read up to it before routing (PeekMore), so
// that siblings read however their bytes arrived agree.
const CreditWindow = 64 << 10

// identTail is how many bytes before the identity's end are hashed: the
// list's length (or the body's) names the rest.
const identTail = 1024

var identSeed = maphash.MakeSeed()

// provisionalBlockSize hashes requests before any event told the block
// size: only credits (siblings of a request placed moments ago) can match
// then.
const provisionalBlockSize = 16

// Matched returns the tokens engine id holds of the request.
func (m *Match) Matched(id EngineID) int { return int(m.Blocks[id]) * m.BlockSize }

// Scan reads the request body's first bytes (body; contentLength the
// whole body's length, -1 when unknown) into m. ok false: no token ids in
// it (no such field, a text prompt, no events yet, malformed JSON).
func (x *Index) Scan(body []byte, contentLength int64, m *Match) bool {
	return x.scan(body, contentLength, m, true)
}

// scan is Scan; swar false reads every token id byte by byte (tests
// compare the two).
func (x *Index) scan(body []byte, contentLength int64, m *Match, swar bool) bool {
	*m = Match{}
	bs := x.BlockSize()
	if bs == 0 {
		bs = provisionalBlockSize
	}
	if len(body) == 0 {
		return false
	}
	start, salt, ok := x.findTokens(body)
	if !ok {
		return false
	}
	m.BlockSize = bs
	m.body = contentLength
	var blk [maxBlockSize]uint32
	var keys [32]uint64
	nb, nk := 0, 0
	chain := uint64(rootChain)
	alive := x.live.Load()
	i := start
	var v uint64
	digits := 0
scan:
	for ; i < len(body); i++ {
		c := body[i]
		if d := c - '0'; d < 10 {
			if digits == 0 && swar && i+8 <= len(body) {
				// A token id of up to 7 digits, read 8 bytes at a
				// time (swar.go); 8 or more: byte by byte below.
				w := le64(body[i:])
				if n := digitRun(w); n > 0 && n < 8 {
					v, digits = digitsValue(w, n), n
					i += n - 1 // the loop's i++: the byte after the id
					continue
				}
			}
			v = v*10 + uint64(d)
			digits++
			continue
		}
		if digits > 0 {
			if digits > 10 || v > 1<<32-1 {
				return false
			}
			blk[nb] = uint32(v)
			nb++
			m.Tokens++
			v, digits = 0, 0
			if nb == bs {
				chain = blockHash(chain, blk[:bs])
				keys[nk] = key(chain, salt)
				nk++
				nb = 0
				if nk == len(keys) {
					alive = x.walk(keys[:nk], alive, m)
					nk = 0
					if alive == 0 {
						break scan
					}
				}
			}
		}
		switch c {
		case ',', ' ', '\n', '\t', '\r':
		case ']':
			m.Complete = true
			break scan
		default:
			return false // not a list of token ids
		}
	}
	if nk > 0 {
		x.walk(keys[:nk], alive, m)
	}
	m.Prompt = m.Tokens
	if !m.Complete && contentLength > 0 && m.Tokens > 0 {
		used := i - start
		if rest := contentLength - int64(i); rest > 0 && used > 0 {
			m.Prompt += int(rest * int64(m.Tokens) / int64(used))
		}
	}
	m.identify(body, start, i, contentLength, salt)
	if m.NBlocks > 0 {
		x.credits.apply(m, time.Now().UnixNano())
	}
	for id, b := range m.Blocks {
		if b > 0 {
			m.Engines |= 1 << uint(id)
		}
	}
	return true
}

// identify sets the prompt's identity (ident): b[start:] is the token-id
// list as read, i where the scan left it (at the list's closing bracket
// when Complete). Siblings (a GRPO group's samples, n samples) name the
// same identity however far their scans went (the engines' events come in
// between), which a block key at the scan's end would not: their credits
// would miss each other. Without allocation: one vectorized search for
// the list's end past the scan, and identTail bytes hashed.
func (m *Match) identify(b []byte, start, i int, contentLength int64, salt uint64) {
	end, closed := i, m.Complete
	if !closed {
		lim := min(len(b), start+CreditWindow)
		if i < lim {
			if j := bytes.IndexByte(b[i:lim], ']'); j >= 0 {
				end, closed = i+j, true
			}
		}
		if !closed {
			end = lim
			m.identShort = lim-start < CreditWindow && (contentLength < 0 || int64(len(b)) < contentLength)
		}
	}
	h := maphash.Bytes(identSeed, b[max(start, end-identTail):end])
	m.ident = fmix(h^uint64(end-start)*m2) ^ salt
	m.identExact = closed
}

// Short: the bytes scanned hold neither the token-id list's end nor
// CreditWindow of it, and the body goes on: read further, the prompt's
// identity (its credits' key) would be another.
func (m *Match) Short() bool { return m.identShort }

// walk looks a run of block keys up under one read lock and returns the
// engines that hold all of them. An engine's cache is prefix-closed (an
// engine announces a block only with its parent, and evicts leaves first:
// SGLang's radix tree, vLLM's free queue, which frees a request's blocks
// tail first), so holding a run's last block means holding the run: one
// lookup per run for the engines that keep up, and a bisection for those
// that drop out in it (about 5 lookups per distinct depth) instead of a
// lookup per block.
func (x *Index) walk(keys []uint64, alive uint64, m *Match) uint64 {
	n := len(keys)
	base := m.NBlocks
	x.mu.RLock()
	held := x.tab.get(keys[n-1]) & alive
	if gone := alive &^ held; gone != 0 {
		x.bisect(keys, 0, n-1, gone, base, m)
	}
	x.mu.RUnlock()
	m.NBlocks += n
	m.Last = keys[n-1]
	if held == 0 {
		m.Stopped = true
		// Every engine dropped out: the last block hashed is the first
		// one none holds (the key credits are stored under).
		first := n
		for id, b := range m.Blocks {
			if alive&(1<<uint(id)) != 0 && int(b)-base < first {
				first = int(b) - base
			}
		}
		if first < n {
			m.NBlocks = base + first + 1
			m.Last = keys[first]
		}
	}
	for a := held; a != 0; a &= a - 1 {
		m.Blocks[bits.TrailingZeros64(a)] = uint16(min(base+n, 1<<16-1))
	}
	if held != 0 {
		m.heldKey = keys[n-1]
	} else {
		deep := 0
		for a := alive; a != 0; a &= a - 1 {
			deep = max(deep, int(m.Blocks[bits.TrailingZeros64(a)])-base)
		}
		if deep > 0 {
			m.heldKey = keys[deep-1]
		}
	}
	return held
}

// bisect sets the depth of the engines in set, each holding between lo
// and hi of keys' leading blocks.
func (x *Index) bisect(keys []uint64, lo, hi int, set uint64, base int, m *Match) {
	for set != 0 {
		if lo == hi {
			for a := set; a != 0; a &= a - 1 {
				m.Blocks[bits.TrailingZeros64(a)] = uint16(min(base+lo, 1<<16-1))
			}
			return
		}
		mid := (lo + hi + 1) / 2
		h := x.tab.get(keys[mid-1]) & set
		if h != 0 {
			x.bisect(keys, mid, hi, h, base, m)
		}
		set &^= h
		hi = mid - 1
	}
}

// findTokens finds the token-id list among the top-level fields of the
// JSON object in b and the namespace salt (SGLang "lora_path" or
// "lora_name"; vLLM names an adapter in "model"): the index of the first
// id, the salt.
func (x *Index) findTokens(b []byte) (int, uint64, bool) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return 0, 0, false
	}
	i++
	tokens := -1
	var salt uint64
	for {
		i = skipSpace(b, i)
		if i >= len(b) || b[i] != '"' {
			break
		}
		ke, ok := scanString(b, i)
		if !ok {
			break
		}
		k := b[i+1 : ke-1]
		i = skipSpace(b, ke)
		if i >= len(b) || b[i] != ':' {
			break
		}
		i = skipSpace(b, i+1)
		if tokens < 0 && i < len(b) && b[i] == '[' && dialect.IsTokenIDField(k) {
			j := skipSpace(b, i+1)
			if j < len(b) && b[j] == '[' {
				j++ // a batch: its first prompt
			}
			tokens = j
		}
		if i < len(b) && b[i] == '"' {
			if ve, ok := scanString(b, i); ok {
				v := b[i+1 : ve-1]
				switch string(k) {
				case "lora_path", "lora_name":
					salt = saltBytes(v)
				case "model":
					if salt == 0 && x.KnowsLoRA(v) {
						salt = saltBytes(v)
					}
				}
			}
		}
		end, complete := skipValue(b, i)
		if !complete {
			break
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ',' {
			break
		}
		i++
	}
	return tokens, salt, tokens >= 0
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// scanString returns the index after the JSON string at b[i] == '"'.
func scanString(b []byte, i int) (int, bool) {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1, true
		}
	}
	return len(b), false
}

// skipValue returns the end of the JSON value at b[i] and whether it is
// complete within b.
func skipValue(b []byte, i int) (int, bool) {
	if i >= len(b) {
		return len(b), false
	}
	switch b[i] {
	case '"':
		return scanString(b, i)
	case '[', '{':
		if b[i] == '[' {
			// A flat list of numbers (token ids): one vectorized search.
			k := bytes.IndexByte(b[i+1:], ']')
			if k < 0 {
				k = len(b) - i - 1
			}
			if seg := b[i+1 : i+1+k]; bytes.IndexByte(seg, '[') < 0 && bytes.IndexByte(seg, '{') < 0 && bytes.IndexByte(seg, '"') < 0 {
				if i+1+k == len(b) {
					return len(b), false
				}
				return i + 2 + k, true
			}
		}
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				e, ok := scanString(b, j)
				if !ok {
					return len(b), false
				}
				j = e - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1, true
				}
			}
		}
		return len(b), false
	}
	for j := i; j < len(b); j++ {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j, true
		}
	}
	return len(b), false
}

// lookupTokens is Scan for token ids already in hand (benchmarks, tests,
// tether-rlsim's checks): every full block hashed and looked up.
func (x *Index) lookupTokens(t []uint32, salt uint64, m *Match) {
	*m = Match{BlockSize: x.BlockSize(), Tokens: len(t), Prompt: len(t), Complete: true}
	bs := m.BlockSize
	if bs == 0 {
		return
	}
	var keys [32]uint64
	nk := 0
	chain := uint64(rootChain)
	alive := x.live.Load()
	for i := 0; i+bs <= len(t) && alive != 0; i += bs {
		chain = blockHash(chain, t[i:i+bs])
		keys[nk] = key(chain, salt)
		if nk++; nk == len(keys) {
			alive = x.walk(keys[:], alive, m)
			nk = 0
		}
	}
	if nk > 0 && alive != 0 {
		x.walk(keys[:nk], alive, m)
	}
}

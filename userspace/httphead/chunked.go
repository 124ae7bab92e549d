package httphead

// Chunked validates chunked framing (RFC 9112 §7.1) as a stream, so the
// proxy can forward the received bytes unchanged as soon as they are known
// to be well framed: it never re-chunks, and it never reads past the end of
// the message (the rest of the buffer belongs to the next message).
//
// The zero value is ready for a new body.
type Chunked struct {
	state    chunkState
	size     int64 // size being parsed / data bytes left in the chunk
	digits   int
	extBytes int // chunk-extension bytes in this message
	// ExtLimit is the most chunk-extension bytes allowed in the message;
	// 0: MaxChunkExtBytes.
	ExtLimit int
	trailer  int // trailer bytes in this message
	nameEnd  bool
	name     [20]byte // start of the current trailer field name, lowercased
	nameLen  int
}

type chunkState uint8

const (
	csSize          chunkState = iota // hex digits
	csSizeWS                          // BWS after the size or an extension value, before ';'
	csExt                             // after ';': BWS, then an extension name
	csExtName                         // chunk-ext-name
	csExtNameWS                       // BWS after the name, before '=' or ';'
	csExtVal                          // after '=': BWS, then a token or quoted-string
	csExtToken                        // token value
	csExtQuoted                       // inside a quoted-string value
	csExtQuotedPair                   // after '\\' in a quoted-string
	csExtQuoteEnd                     // after the closing quote
	csSizeLF                          // LF ending the size line
	csData                            // chunk data
	csDataCR                          // CR after data
	csDataLF                          // LF after data
	csTrailer                         // start of a trailer line (or the final CRLF)
	csTrailerLine                     // inside a trailer line
	csTrailerLF                       // LF ending a trailer line
	csEndLF                           // LF of the final CRLF
	csDone
)

// Limits on framing overhead (chunk-extension amplification, Go CVE-2023-39326).
const (
	MaxChunkExtBytes = 4096
	MaxTrailerBytes  = 16 << 10
	maxSizeDigits    = 16
)

// ChunkError is a framing violation. Request bodies answer Status;
// response bodies are a backend failure (502 or visible truncation).
type ChunkError = Error

func chunkErr(status int, reason string) error { return &Error{Status: status, Reason: reason} }

// extOver reports whether the message's chunk extensions passed the limit.
func (c *Chunked) extOver() bool {
	lim := c.ExtLimit
	if lim == 0 {
		lim = MaxChunkExtBytes
	}
	return c.extBytes > lim
}

// Done reports whether the whole body, trailers included, was scanned.
func (c *Chunked) Done() bool { return c.state == csDone }

// Data returns how many bytes of chunk data may be moved without looking at
// them (the rest of the current chunk); 0 outside chunk data.
func (c *Chunked) Data() int64 {
	if c.state == csData {
		return c.size
	}
	return 0
}

// Skip records n bytes of chunk data moved without Scan; n <= Data().
func (c *Chunked) Skip(n int64) {
	if c.state != csData {
		return // Skip(0) outside chunk data must not touch the state
	}
	c.size -= n
	if c.size == 0 {
		c.state = csDataCR
	}
}

// Scan validates p, a continuation of the body. It returns how many bytes
// of p belong to the body; n < len(p) only when the body ended inside p.
// An error means the framing is invalid: nothing after the last valid byte
// may be forwarded.
func (c *Chunked) Scan(p []byte) (int, error) {
	i := 0
	for i < len(p) {
		b := p[i]
		if c.state >= csSizeWS && c.state <= csExtQuoteEnd && b != '\r' {
			// Every byte of the size line after the size counts against
			// the cap, BWS included.
			c.extBytes++
			if c.extOver() {
				return i, chunkErr(400, "chunk extensions too long")
			}
		}
		switch c.state {
		case csSize:
			switch {
			case hexVal(b) >= 0:
				if c.digits == maxSizeDigits || c.size > (1<<63-1)>>4 {
					return i, chunkErr(400, "chunk size too large")
				}
				c.size = c.size<<4 | int64(hexVal(b))
				c.digits++
			case c.digits == 0:
				return i, chunkErr(400, "bad chunk size")
			case b == '\r':
				c.state = csSizeLF
			case b == ';' || b == ' ' || b == '\t':
				c.extBytes++
				if c.extOver() {
					return i, chunkErr(400, "chunk extensions too long")
				}
				c.state = csSizeWS
				if b == ';' {
					c.state = csExt
				}
			default:
				return i, chunkErr(400, "bad chunk size")
			}
		case csSizeWS:
			switch b {
			case ' ', '\t':
			case ';':
				c.state = csExt
			default:
				return i, chunkErr(400, "whitespace in chunk size line")
			}
		// chunk-ext = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )
		// (RFC 9112 §7.1.1), parsed strictly: a bare LF or CR inside an
		// extension is the Kestrel CVE-2025-55315 smuggling vector.
		case csExt:
			switch {
			case b == ' ' || b == '\t':
			case tchar[b]:
				c.state = csExtName
			default:
				return i, chunkErr(400, "bad chunk extension")
			}
		case csExtName, csExtToken, csExtQuoteEnd:
			switch {
			case b == '\r':
				c.state = csSizeLF
			case b == ';':
				c.state = csExt
			case b == ' ' || b == '\t':
				if c.state == csExtName {
					c.state = csExtNameWS
				} else {
					c.state = csSizeWS
				}
			case b == '=' && c.state == csExtName:
				c.state = csExtVal
			case tchar[b] && c.state != csExtQuoteEnd:
			default:
				return i, chunkErr(400, "bad chunk extension")
			}
		case csExtNameWS:
			switch b {
			case ' ', '\t':
			case ';':
				c.state = csExt
			case '=':
				c.state = csExtVal
			default:
				return i, chunkErr(400, "bad chunk extension")
			}
		case csExtVal:
			switch {
			case b == ' ' || b == '\t':
			case b == '"':
				c.state = csExtQuoted
			case tchar[b]:
				c.state = csExtToken
			default:
				return i, chunkErr(400, "bad chunk extension")
			}
		case csExtQuoted:
			switch {
			case b == '"':
				c.state = csExtQuoteEnd
			case b == '\\':
				c.state = csExtQuotedPair
			case b < ' ' && b != '\t' || b == 0x7f:
				return i, chunkErr(400, "bad byte in chunk extension")
			}
		case csExtQuotedPair:
			if b < ' ' && b != '\t' || b == 0x7f {
				return i, chunkErr(400, "bad byte in chunk extension")
			}
			c.state = csExtQuoted
		case csSizeLF:
			if b != '\n' {
				return i, chunkErr(400, "bare CR in chunk size line")
			}
			c.digits = 0
			if c.size == 0 {
				c.state = csTrailer
			} else {
				c.state = csData
			}
		case csData:
			n := int64(len(p) - i)
			if n > c.size {
				n = c.size
			}
			i += int(n)
			c.size -= n
			if c.size == 0 {
				c.state = csDataCR
			}
			continue
		case csDataCR:
			if b != '\r' {
				return i, chunkErr(400, "missing CRLF after chunk data")
			}
			c.state = csDataLF
		case csDataLF:
			if b != '\n' {
				return i, chunkErr(400, "missing CRLF after chunk data")
			}
			c.state = csSize
		case csTrailer:
			switch {
			case b == '\r':
				c.state = csEndLF
			case tchar[b]:
				c.state = csTrailerLine
				c.nameEnd = false
				c.nameLen = 0
				c.addName(b)
			default:
				// includes obs-fold (SP/HT) and bare LF
				return i, chunkErr(400, "bad trailer line")
			}
			if err := c.countTrailer(); err != nil {
				return i, err
			}
		case csTrailerLine:
			if err := c.countTrailer(); err != nil {
				return i, err
			}
			switch {
			case b == '\r':
				if !c.nameEnd {
					return i, chunkErr(400, "trailer field without colon")
				}
				c.state = csTrailerLF
			case !c.nameEnd && b == ':':
				c.nameEnd = true
				if c.forbiddenTrailer() {
					return i, chunkErr(400, "forbidden trailer field")
				}
			case !c.nameEnd:
				if !tchar[b] {
					return i, chunkErr(400, "bad trailer field name")
				}
				c.addName(b)
			case b < ' ' && b != '\t' || b == 0x7f:
				return i, chunkErr(400, "control byte in trailer")
			}
		case csTrailerLF:
			if b != '\n' {
				return i, chunkErr(400, "bare CR in trailer")
			}
			c.state = csTrailer
		case csEndLF:
			if b != '\n' {
				return i, chunkErr(400, "bare CR at end of chunked body")
			}
			c.state = csDone
			return i + 1, nil
		case csDone:
			return i, nil
		}
		i++
	}
	return i, nil
}

func (c *Chunked) countTrailer() error {
	c.trailer++
	if c.trailer > MaxTrailerBytes {
		return chunkErr(431, "trailers too large")
	}
	return nil
}

func (c *Chunked) addName(b byte) {
	if c.nameLen < len(c.name) {
		if 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		c.name[c.nameLen] = b
	}
	c.nameLen++
}

// forbiddenTrailer: framing and routing fields must never come late.
func (c *Chunked) forbiddenTrailer() bool {
	if c.nameLen > len(c.name) {
		return false
	}
	switch string(c.name[:c.nameLen]) {
	case "content-length", "transfer-encoding", "host", "trailer", "connection":
		return true
	}
	return false
}

func hexVal(b byte) int {
	switch {
	case '0' <= b && b <= '9':
		return int(b - '0')
	case 'a' <= b && b <= 'f':
		return int(b-'a') + 10
	case 'A' <= b && b <= 'F':
		return int(b-'A') + 10
	}
	return -1
}

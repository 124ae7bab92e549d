// Responses: ParseResponse, the status line, and what a response's fields
// decide (framing, Connection).

package httphead

import (
	"bytes"
)

// ParseResponse parses the response head at the start of buf into resp.
// It returns ErrIncomplete, or an *Error (status 502: the backend broke the
// protocol).
func ParseResponse(buf []byte, lim Limits, resp *Response) error {
	lim = lim.withDefaults()
	fields := resp.Fields[:0]
	*resp = Response{Fields: fields, ContentLength: -1}
	it := lineIter{buf: buf}
	line, _, err := it.next()
	if err == ErrIncomplete {
		if len(buf) >= lim.Head {
			return reject(502, "response head too large")
		}
		return err
	}
	if err != nil {
		return reject(502, "bad line ending in response head")
	}
	// status-line = HTTP-version SP 3DIGIT SP [reason]
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return reject(502, "bad status line")
	}
	switch line[7] {
	case '0':
		resp.Minor = 0
	case '1':
		resp.Minor = 1
	default:
		return reject(502, "bad response version")
	}
	code := line[9:12]
	if !allDigits(code) || code[0] == '0' || len(line) > 12 && line[12] != ' ' {
		return reject(502, "bad status code")
	}
	resp.Status = int(code[0]-'0')*100 + int(code[1]-'0')*10 + int(code[2]-'0')
	for _, c := range line[12:] {
		if c < ' ' && c != '\t' || c == 0x7f {
			return reject(502, "control byte in reason")
		}
	}
	n, err := parseFields(&it, lim, &resp.Fields)
	if err == ErrIncomplete {
		return err
	}
	if err != nil {
		return reject(502, "bad response field")
	}
	resp.HeadLen = n
	var (
		cls, tes int
		conn     connTokens
	)
	for i := range resp.Fields {
		f := &resp.Fields[i]
		switch {
		case equalFold(f.Name, "Content-Length"):
			cls++
			v, ok := parseContentLength(f.Value)
			if !ok {
				return reject(502, "bad Content-Length in response")
			}
			resp.ContentLength = v
		case equalFold(f.Name, "Transfer-Encoding"):
			tes++
			if !equalFold(f.Value, "chunked") {
				return reject(502, "unsupported Transfer-Encoding in response")
			}
		case equalFold(f.Name, "Connection"):
			if err := conn.add(f.Value); err != nil {
				return reject(502, "bad Connection in response")
			}
			f.Drop = true
		}
	}
	if cls > 1 || tes > 1 || cls > 0 && tes > 0 {
		return reject(502, "ambiguous response framing")
	}
	resp.Chunked = tes == 1
	if tes == 1 && resp.Minor == 0 {
		return reject(502, "Transfer-Encoding in HTTP/1.0 response")
	}
	if err := conn.apply(resp.Fields, false); err != nil {
		return err
	}
	resp.Close = conn.close || resp.Minor == 0 && !conn.keepAlive
	return nil
}

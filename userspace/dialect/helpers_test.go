package dialect

import (
	"encoding/json"
	"net/url"
)

func object(b []byte) (map[string]json.RawMessage, bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil || m == nil {
		return nil, false
	}
	return m, true
}

func parseQuery(s string) (url.Values, error) { return url.ParseQuery(s) }

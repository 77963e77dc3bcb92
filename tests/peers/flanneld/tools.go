//go:build tools

package tools

import _ "github.com/flannel-io/flannel"

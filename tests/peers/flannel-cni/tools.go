//go:build tools

package tools

import _ "github.com/containernetworking/plugins/plugins/meta/flannel"

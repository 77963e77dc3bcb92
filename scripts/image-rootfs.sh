#!/usr/bin/env bash
# The flannelpy image's root filesystem, made in a Debian 12 stage of manifests/Dockerfile
# where the packages named are installed:
#
#   scripts/image-rootfs.sh DEST PACKAGE...
#
# DEST gets the files of every PACKAGE and of the packages it depends on, recursively,
# except the packages a running container never needs (those that install and configure
# packages, perl, the shells and utilities busybox stands in for) and the files no program
# there reads (documentation but its copyright files, manual pages, translations, glibc's
# iconv modules). Then the few files package scripts write rather than ship: the iptables
# alternatives, the CA bundle, passwd and group, the dynamic linker's cache.
set -euo pipefail

dest=$1
shift
# Dependencies the image does without: nothing installs or configures a package there
# (ca-certificates needs openssl only to do so), and busybox is its shell and its file
# utilities.
SKIP=" dpkg debconf debconf-2.0 cdebconf perl-base apt coreutils debianutils dash bash
  init-system-helpers libc-bin sensible-utils readline-common adduser passwd login
  lsb-base tzdata ucf openssl "
# Directories whose files no program in the image reads (a copyright file excepted).
LEFT_OUT="/usr/share/doc /usr/share/man /usr/share/info /usr/share/locale /usr/share/lintian
  /usr/share/bash-completion /usr/share/bug /usr/lib/x86_64-linux-gnu/gconv"
# busybox's applets the image links: the init container's copy, what the agent's start of
# wireguard-go runs beside mount, and a few to look around with.
APPLETS=(sh cp chmod mv mkdir unshare cat ls ln rm grep head ps)

installed() {
  dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null | grep -qx installed
}

# provider NAME: NAME itself when installed, else the installed package that provides it.
provider() {
  if installed "$1"; then
    echo "$1"
    return
  fi
  dpkg-query -W -f='${Package} ${Provides}\n' \
    | awk -v want="$1" '{ for (i = 2; i <= NF; i++) { sub(/,$/, "", $i); if ($i == want) { print $1; exit } } }'
}

# The closure of the packages named, without SKIP.
declare -A chosen
queue=("$@")
while ((${#queue[@]})); do
  pkg=${queue[0]}
  queue=("${queue[@]:1}")
  [[ -n ${chosen[$pkg]:-} || $SKIP == *" $pkg "* ]] && continue
  installed "$pkg" || { echo "image-rootfs: $pkg is not installed in this stage" >&2; exit 1; }
  chosen[$pkg]=1
  IFS=, read -ra depends <<<"$(dpkg-query -W -f='${Pre-Depends},${Depends}' "$pkg")"
  for alternatives in "${depends[@]}"; do
    [[ -z ${alternatives// /} ]] && continue
    found=""
    for alternative in ${alternatives//|/ }; do  # the first alternative present wins
      name=${alternative%%:*}
      [[ $name == \(* || $name == *\) || $name =~ ^[\<\>=] || $name =~ ^[0-9] ]] && continue
      [[ $SKIP == *" $name "* ]] && { found=skip; break; }
      found=$(provider "$name")
      [[ -n $found ]] && break
    done
    [[ -z $found ]] && { echo "image-rootfs: nothing installed provides '$alternatives' ($pkg)" >&2; exit 1; }
    [[ $found != skip ]] && queue+=("$found")
  done
done

mkdir -p "$dest/usr"
for dir in bin sbin lib lib64; do  # Debian 12's merged /usr
  mkdir -p "$dest/usr/$dir"
  ln -sfn "usr/$dir" "$dest/$dir"
done
# Each package's own files and directories, as dpkg lists them, its copyright file kept.
for pkg in "${!chosen[@]}"; do
  dpkg-query -L "$pkg"
done | awk -v dirs="$LEFT_OUT" '
  BEGIN { n = split(dirs, dir) }
  /^\/usr\/share\/doc\/[^\/]+\/copyright$/ { print; next }
  { for (i = 1; i <= n; i++) if (index($0, dir[i] "/") == 1) next; print }' \
  | sed 's|^/||' | sort -u >/tmp/image-rootfs.list
tar -C / --no-recursion --ignore-failed-read -cf - -T /tmp/image-rootfs.list \
  | tar -C "$dest" --keep-directory-symlink -xf -
rm -f /tmp/image-rootfs.list

# What package scripts made rather than shipped: the alternatives (iptables -> iptables-nft)
# whose choice is in DEST, the CA bundle, the users, the linker's search path.
find /usr -lname '/etc/alternatives/*' | while read -r link; do
  alternative=$(readlink "$link")
  if [ -e "$dest$(readlink "$alternative")" ]; then
    mkdir -p "$dest/etc/alternatives"
    cp -P "$link" "$dest$link"
    cp -P "$alternative" "$dest$alternative"
  fi
done
cp -a /etc/ssl/certs "$dest/etc/ssl/"
cp -a /etc/passwd /etc/group /etc/ld.so.conf /etc/ld.so.conf.d "$dest/etc/"
for applet in "${APPLETS[@]}"; do
  ln -sfn busybox "$dest/usr/bin/$applet"
done
mkdir -p "$dest/tmp" "$dest/run" "$dest/proc" "$dest/sys" "$dest/dev" "$dest/var/tmp"
chmod 1777 "$dest/tmp" "$dest/var/tmp"
ln -sfn /run "$dest/var/run"
ldconfig -r "$dest"

#!/bin/busybox sh
# /init of the guest's initramfs (tests/vm/harness.py puts it there with a static busybox and
# the kernel modules listed in /modules/order).
#
# Step 1: the kernel's own file systems, so that insmod and mount have /proc and /dev.
# Step 2: the virtio and 9p modules, in dependency order.
# Step 3: the host's root, read-only, as the new root; tmpfs on its /tmp (keeping the host
#         directories named by kpkeep= at their paths); the writable
#         results share on /tmp/vmout; proc, sysfs, devtmpfs, tracefs and debugfs.
# Step 4: run /tmp/vmout/run.sh in the chroot, its output and exit code into the share.
# Step 5: power off. Any failure before step 4 is reported on the console and powers off too.
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
    echo "vm-init: $*" >/dev/console
    echo o >/proc/sysrq-trigger
    sleep 10
}

# Step 1
mkdir -p /proc /sys /dev /tmp /newroot
mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sysfs /sys || fail "cannot mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "cannot mount /dev"

# Step 2
for m in $(cat /modules/order); do
    insmod "/modules/$m" || fail "insmod $m failed"
done

# Step 3
opts=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot || fail "cannot mount the host's root"
# Host directories under /tmp that the command needs (a checkout there) would vanish under
# the guest's tmpfs: keep them, read-only, at the same paths (kpkeep=/tmp/a,/tmp/b).
keep=$(sed -n 's/.*kpkeep=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
if [ -n "$keep" ]; then
    mkdir -p /hosttmp
    mount -o bind /newroot/tmp /hosttmp || fail "cannot bind the host's /tmp"
fi
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp || fail "cannot mount tmpfs on /tmp"
for path in $keep; do
    mkdir -p "/newroot$path"
    mount -o bind "/hosttmp${path#/tmp}" "/newroot$path" || fail "cannot keep $path"
done
mkdir -p /newroot/tmp/vmout
mount -t 9p -o "$opts" vmout /newroot/tmp/vmout || fail "cannot mount the results share"
mount -t proc proc /newroot/proc || fail "cannot mount proc in the new root"
mount -t sysfs sysfs /newroot/sys || fail "cannot mount sysfs in the new root"
mount -t devtmpfs devtmpfs /newroot/dev || fail "cannot mount devtmpfs in the new root"
mount -t tracefs nodev /newroot/sys/kernel/tracing || fail "cannot mount tracefs"
mount -t debugfs nodev /newroot/sys/kernel/debug || fail "cannot mount debugfs"
mkdir -p /newroot/dev/shm && mount -t tmpfs tmpfs /newroot/dev/shm

# Step 4
echo "vm-init: running the guest command" >/dev/console
chroot /newroot /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp LANG=C.UTF-8 KPROBES_IN_VM=1 \
    /bin/sh /tmp/vmout/run.sh >/newroot/tmp/vmout/output 2>&1
echo $? >/newroot/tmp/vmout/rc

# Step 5
sync
echo o >/proc/sysrq-trigger
sleep 10

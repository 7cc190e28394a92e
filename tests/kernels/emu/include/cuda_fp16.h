// Emulation stand-in for the CUDA header of the same name: the types live in emu.h.
#pragma once
#include "../emu.h"
